"""thinpipe/checkpoint.py: the tree codec round-trips every state thinpipe keeps, files are verified,
a damaged set is refused with one line naming the file, and an older set is used instead."""

from __future__ import annotations

import math

import pytest
import torch

from thinpipe.checkpoint import (
    CheckpointError,
    _permuted_dense,
    decode_tree,
    encode_tree,
    latest_complete,
    load_part,
    prune,
    remove_parts,
    save_part,
    sets,
    step_dir,
)


def nasty_tree():
    w = torch.randn(4, 6)
    return {"step": 3, "lr": 1e-3, "nan": float("nan"), "inf": -math.inf, "none": None, "flag": True,
            "name": "mask", "dtype": torch.bfloat16,
            "w": w, "view": w[:, 1:3], "same": w, "scalar": torch.tensor(2.5), "empty": torch.zeros(0),
            "transposed": torch.randn(5, 3).t(), "permuted": torch.randn(2, 3, 4).permute(2, 0, 1),
            "bf16": torch.randn(3, dtype=torch.bfloat16), "ints": torch.arange(5), "bools": torch.tensor([True, False]),
            "by_int": {0: torch.ones(2), 7: {"__not_a_marker": 1}},
            "in_flight": [(5, 1, {"a": torch.ones(3)})], "nested": [[1, 2.0, "x"], {"k": (None, 3)}]}


def assert_same(a, b):  # a: decoded, b: original
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if _permuted_dense(b):  # b, the original: a transposed tensor comes back transposed (matmuls round by layout)
            assert a.stride() == b.stride()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def test_the_tree_codec_round_trips_through_files(tmp_path):
    tree = nasty_tree()
    save_part(tmp_path, "mesh", tree)
    assert_same(load_part(tmp_path, "mesh"), tree)
    skeleton, tensors = encode_tree(tree)
    assert_same(decode_tree(skeleton, tensors), tree)


def test_a_value_that_would_need_a_pickle_is_refused_when_saving(tmp_path):
    with pytest.raises(TypeError, match="/opt/thing is a object"):
        save_part(tmp_path, "mesh", {"opt": {"thing": object()}})


@pytest.mark.parametrize("name", ["mesh.safetensors", "mesh.json", "mesh.sha256"])
@pytest.mark.parametrize("where", [0, 0.5, -1])
def test_a_flipped_byte_in_any_file_is_detected(tmp_path, name, where):
    save_part(tmp_path, "mesh", nasty_tree())
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    i = int(where * (len(data) - 1)) if where >= 0 else len(data) - 1
    data[i] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        load_part(tmp_path, "mesh")
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)


def test_a_truncated_or_incomplete_part_is_refused(tmp_path):
    save_part(tmp_path, "mesh", nasty_tree())
    st = tmp_path / "mesh.safetensors"
    st.write_bytes(st.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="mesh.safetensors does not match"):
        load_part(tmp_path, "mesh")
    (tmp_path / "mesh.sha256").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_part(tmp_path, "mesh")


def test_the_newest_set_that_verifies_is_used_and_old_sets_are_pruned(tmp_path):
    for step in (2, 4, 6):
        save_part(step_dir(tmp_path, step), "mesh", {"step": step})
    warnings = []
    assert latest_complete(tmp_path, "mesh", warnings.append) == (6, {"step": 6})
    (step_dir(tmp_path, 6) / "mesh.json").write_text('{"format": 1, "state": {"step": 666}}')
    assert latest_complete(tmp_path, "mesh", warnings.append) == (4, {"step": 4})
    assert len(warnings) == 1 and "step 6" in warnings[0] and "mesh.json" in warnings[0]
    prune(tmp_path, 1, ["mesh"])  # the newest set that verifies, and the newer damaged one (maybe still being written)
    assert [s for s, _ in sets(tmp_path)] == [6, 4]
    save_part(step_dir(tmp_path, 8), "mesh", {"step": 8})
    prune(tmp_path, 2, ["mesh"])  # 8 and 4 verify; 6 is older than a verified set and damaged: gone
    assert [s for s, _ in sets(tmp_path)] == [8, 4]


def test_removing_parts_of_a_set_another_rank_already_emptied_and_removed_is_not_an_error(tmp_path):
    """Ranks prune concurrently: the rank that removes the last part also removes the folder, while another
    rank (whose part of that set was never complete) may be about to look inside it (found by CI)."""
    folder = step_dir(tmp_path, 4)
    save_part(folder, "rank0", {"step": 4})
    (folder / ".rank1.safetensors.tmp").write_bytes(b"interrupted")
    remove_parts(folder, ["rank1"])       # rank 1's leftovers go; rank 0's part stays
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.json", "rank0.safetensors", "rank0.sha256"]
    remove_parts(folder, ["rank0"])
    assert not folder.exists()
    remove_parts(folder, ["rank1"])       # the folder is gone: nothing to do, no error


def test_no_set_at_all_is_none_and_only_damaged_sets_is_an_error(tmp_path):
    assert latest_complete(tmp_path / "nothing", "mesh") is None
    save_part(step_dir(tmp_path, 1), "mesh", {"a": 1})
    (step_dir(tmp_path, 1) / "mesh.sha256").unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        latest_complete(tmp_path, "mesh")


def test_a_resumed_run_with_a_transposed_parameter_evaluates_bitwise_alike(tmp_path):
    """MAPL's projector A is a transposed Parameter and SPEL's momentum inherits its layout: stored
    contiguous, the resumed run's final held-out loss differed in the 7th digit (found by the dist
    crash/resume test)."""
    from tests.helpers import config, engine_step
    from thinpipe.engine.sim_engine import SimEngine

    sets = dict(model__name="tiny-llama", data__name="synthetic", train__steps=6, train__batch_size=2,
                train__seq_len=32, train__microbatches=2, train__lr=1e-3, mesh__pp=3, boundary__kind="mapl-vq",
                boundary__rank=16, boundary__vq_codes=32, boundary__vq_sync_codes=4)
    a = SimEngine(config(**sets))
    for s in range(3):
        engine_step(a, s)
    a.save(tmp_path, {"val_points": []})
    b = SimEngine(config(**sets))
    assert b.load(tmp_path)[0] == 3
    assert [engine_step(a, s) for s in range(3, 6)] == [engine_step(b, s) for s in range(3, 6)]
    assert a.objective.validation() == b.objective.validation()
