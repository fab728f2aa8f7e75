"""``thinpipe probe`` (issue 17): exact bytes, a dense arm that is the dense model, and the advice
that keeps a damage bound (``plan --probe``)."""

import copy
import json
import math
from types import SimpleNamespace

import pytest

import thinpipe.commands.probe_lib as probe_module
from thinpipe.cli import main
from thinpipe.commands.probe_lib import GRID, PROBE_MESH, _grads, cosine, measure_arm, probe, select_grid
from thinpipe.config import ConfigError, apply_overrides, load_config
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.objective.registry import build_data
from thinpipe.plan.advice import advise, candidates, load_probe
from thinpipe.plan.planner import DEVICES, PRESETS, activation_fraction
from thinpipe.rank.from_config import load, place, residual_batches, val_batches

TINY = ["model.name=tiny-llama", "data.name=synthetic", "mesh.pp=3", "train.seq_len=32", "train.batch_size=2",
        "train.microbatches=1"]


@pytest.fixture(scope="module")
def probed():
    cfg = load_config(None, TINY)
    grid = [a for a in GRID if a[0] in ("dense", "mask p=0.9", "topk p=0.9", "quant4", "quant 2b/8b", "mapl r=32 pca")]
    return cfg, probe(cfg, grid, num_batches=2, progress=False, forward_cosine=False)


@pytest.mark.slow
def test_cos_fwd_is_the_gradients_cosine_with_only_the_forward_compressed():
    """``cos_fwd`` (issue 52): the backward made exact. An arm whose backward is already exact has it equal to its
    gradient cosine; a codec's is the forward's share of its damage; a kind that is part of the model has none."""
    grid = [a for a in GRID if a[0] in ("dense", "quant 2b/8b", "mapl r=32 pca")]
    grid.append(("outlier 2b fwd only", {"boundary.kind": "outlier", "boundary.compress": "fwd"}))
    r = probe(load_config(None, TINY), grid, num_batches=1, progress=False)
    arms = {a["arm"]: a for a in r["arms"]}
    assert arms["dense"]["cos_fwd"] == 1.0 and arms["mapl r=32 pca"]["cos_fwd"] is None
    one_way = arms["outlier 2b fwd only"]
    assert one_way["cos_fwd"] == pytest.approx(one_way["grad_cosine"], abs=1e-12) and one_way["cos_fwd"] < 0.999
    q = arms["quant 2b/8b"]  # a 2-bit forward, an 8-bit backward: nearly all of its damage is the forward's
    assert q["grad_cosine"] < q["cos_fwd"] < 1.0 and q["cos_fwd"] == pytest.approx(q["grad_cosine"], abs=0.05)


def test_the_dense_arm_is_the_dense_model_and_bytes_are_the_formula(probed):
    cfg, r = probed
    arms = {a["arm"]: a for a in r["arms"]}
    H, links = 64, cfg.mesh.pp - 1  # tiny-llama's hidden size; two boundaries
    d = arms["dense"]
    assert d["damage_nats"] == 0.0 and d["loss"] == r["dense_loss"] and math.isfinite(d["loss"])
    assert d["grad_cosine"] == pytest.approx(1.0, abs=1e-9)
    assert d["fwd_bytes_per_token"] == d["bwd_bytes_per_token"] == H * 4 * links
    m = arms["mask p=0.9"]
    assert m["fwd_bytes_per_token"] == m["bwd_bytes_per_token"] == round(0.1 * H) * 4 * links  # no indices: a PRF
    # the compressed arms change the function and its gradient (the probe is not vacuous)
    assert m["damage_nats"] != 0.0 and m["grad_cosine"] < 0.99 and arms["quant4"]["grad_cosine"] < 1.0


@pytest.mark.parametrize("arm", ["topk p=0.9", "quant4", "quant 2b/8b"])
def test_measured_bytes_equal_the_planners_formula(probed, arm):
    """The meter of the simulated mesh and ``plan``'s closed form agree on each kind's bytes."""
    cfg, r = probed
    row = next(a for a in r["arms"] if a["arm"] == arm)
    c = copy.deepcopy(cfg)
    apply_overrides(c, row["settings"])
    assert row["pp_fraction"] == pytest.approx(activation_fraction(c, SimpleNamespace(hidden=64), 4), rel=1e-12)


def test_probe_cli_writes_json_and_plot_and_refuses_bad_input(tmp_path, capsys):
    sets = [x for s in TINY for x in ("--set", s)]
    assert main(["probe", *sets, "--kinds", "mask", "--batches", "1", "--out", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [a["arm"] for a in out["arms"]] == ["dense", "mask p=0.5", "mask p=0.9", "mask p=0.95"]
    assert json.loads((tmp_path / "probe.json").read_text()) == out and (tmp_path / "probe.png").stat().st_size > 0
    for bad, says in ((["--kinds", "nope"], "no probe arms for nope"), (["--boundaries", "5"], "boundaries are 0..1"),
                      (["--batches", "0"], "--batches must be >= 1"), (["--boundaries", "x"], "comma-separated")):
        assert main(["probe", *sets, *bad]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and err.count("\n") == 1


def _stored_gradient_arm(model, cfg, device, batches, train_ds):
    """The probe before issue 26 (item 6): every batch's gradient of the arm stored, compared afterwards."""
    mesh = SimMesh(model, cfg, device)
    if any(b.wants_residual_init for b in mesh.boundaries):
        mesh.residual_start(residual_batches(cfg, train_ds))
    losses, grads = [], []
    for i, batch in enumerate(batches):
        mesh.step_index = i
        losses.append(mesh.forward_backward([batch]))
        grads.append(_grads(mesh))
    return sum(losses) / len(losses), grads


def test_streamed_cosines_equal_the_stored_gradient_way():
    """Each arm's cosines, computed batch by batch against the dense gradients and then dropped, are
    exactly (==) those of the arm's stored gradients; loss too. Learned kind (MAPL, own parameters)
    included."""
    base = load_config(None, TINY)
    apply_overrides(base, PROBE_MESH)
    device, loaded = place(base), load(base)
    train_ds, val_ds = build_data(base, loaded.tokenizer)
    batches = [b for _, b in zip(range(2), val_batches(val_ds, base.train.batch_size))]
    dense = measure_arm(loaded.model, base, device, batches, train_ds)
    assert [c for c, _ in dense["cosines"]] == pytest.approx([1.0, 1.0], abs=1e-12)
    for arm in ("mask p=0.9", "quant4", "mapl r=32 pca"):
        c = copy.deepcopy(base)
        apply_overrides(c, dict(GRID)[arm])
        c.validate()
        new = measure_arm(loaded.model, c, device, batches, train_ds, dense_grads=dense["grads"])
        loss, grads = _stored_gradient_arm(loaded.model, c, device, batches, train_ds)
        old = [cosine(g, d) for g, d in zip(grads, dense["grads"])]
        assert "grads" not in new and new["loss"] == loss and new["cosines"] == old, arm
        assert all(cs < 0.999 for cs, _ in old), arm  # a compressed arm: the comparison is not of two 1s


def test_each_arms_mesh_is_freed_before_the_next_is_built(monkeypatch):
    """What grows with the number of arms: the meshes (each a copy of the model) must not outlive their arm."""
    import weakref

    made = []

    class Tracked(SimMesh):
        def __init__(self, *a, **k):
            alive = [m for m in made if m() is not None]
            assert not alive, f"{len(alive)} earlier arm mesh(es) still alive when arm {len(made)} starts"
            super().__init__(*a, **k)
            made.append(weakref.ref(self))

    monkeypatch.setattr(probe_module, "SimMesh", Tracked)
    cfg = load_config(None, TINY)
    grid = [a for a in GRID if a[0] in ("dense", "mask p=0.9", "quant4", "mapl r=32 pca")]
    probe(cfg, grid, num_batches=1, progress=False)
    assert len(made) == 6  # 4 arms and the cos_fwd passes of mask and quant4, each freed before the next


def test_select_grid_keeps_dense():
    assert [a for a, _ in select_grid(["quant4"])] == ["dense", "quant4"]
    with pytest.raises(ConfigError):
        select_grid(["mask", "bogus"])


# -- advice within a damage bound, on a synthetic probe of the paper's model -----------------------
def _paper(*sets):
    s = {**PRESETS["paper-llama1b"], **dict(x.split("=", 1) for x in sets)}
    return load_config(None, [f"{k}={v}" for k, v in s.items()])


def _probe_file(tmp_path, model="llama-3.2-1b", pp=8):
    arms = [("dense", {"boundary.kind": "identity"}, 0.0, 1.0),
            ("mask p=0.5", {"boundary.kind": "mask", "boundary.p": 0.5}, 0.004, 0.5),
            ("mask p=0.95", {"boundary.kind": "mask", "boundary.p": 0.95}, 0.9, 0.05),
            ("quant4", {"boundary.kind": "quant4"}, 0.002, 0.28),
            ("mapl r=64 pca", {"boundary.kind": "mapl", "boundary.rank": 64, "boundary.init": "pca"}, 0.008, 0.03)]
    doc = {"model": model, "pp": pp, "arms": [{"arm": a, "kind": s["boundary.kind"], "settings": s, "damage_rel": d,
                                               "pp_fraction": f} for a, s, d, f in arms]}
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("target", [2500, 6000, 20000])
def test_advice_with_a_probe_is_the_least_damaged_setting_that_meets_the_target(tmp_path, target):
    cfg, dev, path = _paper(), DEVICES["a100-40gb"], _probe_file(tmp_path)
    a = advise(cfg, dev, target_tps=target, probe=path, max_damage=0.01)
    assert a["quality"].startswith("checked")
    assert a["feasible"] and a["plan"]["tokens_per_s"] >= target and a["damage"] <= 0.01
    assert a["settings"]["boundary.kind"] != "mask" or a["settings"]["boundary.p"] != "0.95"  # 90% damage: never
    # every less damaged probed setting misses the target (or the staleness limit)
    for c in candidates(cfg, dev, load_probe(path, cfg, 0.01)):
        if c.boundary.damage < a["damage"]:
            assert c.result["tokens_per_s"] < target


def test_advice_with_a_probe_names_the_closest_on_each_side_when_nothing_meets_both(tmp_path):
    cfg, dev, path = _paper(), DEVICES["a100-40gb"], _probe_file(tmp_path)
    a = advise(cfg, dev, target_tps=60000, probe=path, max_damage=0.001)  # only dense is that good
    assert not a["feasible"]
    assert a["closest_within_damage"]["settings"]["boundary.kind"] == "identity"
    assert "within the bound the fastest" in a["why"]
    assert main(["plan", "--preset", "paper-llama1b", "--target-tps", "60000", "--probe", str(path),
                 "--max-damage", "0.001"]) == 1


def test_advice_without_a_probe_says_quality_was_not_checked_and_a_wrong_probe_is_one_line(tmp_path, capsys):
    cfg, dev = _paper(), DEVICES["a100-40gb"]
    assert advise(cfg, dev, target_tps=3000)["quality"].startswith("not checked")
    assert main(["plan", "--preset", "paper-llama1b", "--target-tps", "3000"]) == 0
    assert "quality: not checked" in capsys.readouterr().out
    wrong = _probe_file(tmp_path, model="smollm2-135m", pp=4)
    for path, says in ((wrong, "probed smollm2-135m with 4 stages"), (tmp_path / "none.json", "no such file")):
        assert main(["plan", "--preset", "paper-llama1b", "--target-tps", "3000", "--probe", str(path)]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1
