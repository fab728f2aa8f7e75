"""A distributed rank builds only its own stage, reading only that stage's tensors from the model
folder (``models/stage_loading.py``, ``rank/from_config.py: load_stage``): the stage must be the one
the whole-model path carves, tensor for tensor, and a run from a folder must still equal the
simulation file by file.

The dist equivalence tests elsewhere run the random presets, which load the whole model; these
tests save tiny models into Hugging Face folders so that the folder path is exercised."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.helpers import assert_same_run_files, config, tiny_model
from tests.integration.test_dist import launch
from thinpipe.cli import main
from thinpipe.config import ConfigError
from thinpipe.models import build_stages
from thinpipe.models.stage_loading import ModelOnDisk
from thinpipe.rank.from_config import load, load_stage


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A Hugging Face tokenizer that fits the tiny models' 512-token vocabulary: the 256 byte-level
    symbols (no merges) and the ChatML specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|pad|>")


def save_folder(family: str, folder, shard: str | None = None):
    """Seeded tiny model of ``family`` (llama: untied embeddings, qwen2: tied) + tokenizer, saved as a
    Hugging Face folder (sharded, with an index, when ``shard`` gives a maximum shard size)."""
    model = tiny_model(family, seed=3)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"llama": save_folder("llama", root / "llama"), "qwen2": save_folder("qwen2", root / "qwen2"),
            "qwen2-sharded": save_folder("qwen2", root / "qwen2-sharded", shard="100KB")}


def tensors(stage) -> dict:
    """name -> (values, dtype, requires_grad) of every parameter (shared ones under each name) and buffer."""
    out = {f"param {n}": (p.detach(), p.dtype, p.requires_grad)
           for n, p in stage.named_parameters(remove_duplicate=False)}
    out.update({f"buffer {n}": (b, b.dtype, False) for n, b in stage.named_buffers(remove_duplicate=False)})
    return out


def sharing(stage) -> list[list[str]]:
    """Groups of parameter names that are one tensor (a one-stage tied model's embedding and head)."""
    groups: dict[int, list[str]] = {}
    for n, p in stage.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    return sorted(groups.values())


@pytest.mark.parametrize("lora", [0, 4])
@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2-sharded"])
def test_a_stage_built_alone_equals_the_stage_carved_from_the_whole_model(family, pp, lora, folders):
    cfg = config(model__name=str(folders[family]), mesh__pp=pp, train__lora__rank=lora, train__seed=5)
    model = load(cfg).model
    rng_after_load = torch.random.get_rng_state()
    whole = build_stages(model, None, pp)
    for i in range(pp):
        torch.manual_seed(1234)  # load_stage seeds the global RNG as load does
        loaded = load_stage(cfg, i)
        assert torch.equal(torch.random.get_rng_state(), rng_after_load)
        want, got = whole[i], loaded.stages[i]
        assert isinstance(loaded.model, ModelOnDisk)  # the folder path, not the whole model
        assert repr(got) == repr(want)  # the same modules (peft's wrappers too) in the same places
        assert (got.index, got.first_layer, got.tied_embeddings) == (want.index, want.first_layer, want.tied_embeddings)
        assert [m.training for m in got.modules()] == [m.training for m in want.modules()]
        assert sharing(got) == sharing(want)
        a, b = tensors(want), tensors(got)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name][1:] == b[name][1:], name
            assert torch.equal(a[name][0], b[name][0]), name
        if lora:
            assert any("lora_A" in n for n in a) and all(not r for n, (_, _, r) in a.items() if "lora_" not in n)
        others = [p for j, st in enumerate(loaded.stages) if j != i for p in st.parameters()]
        assert all(p.is_meta for p in others)  # the other stages hold no weights
        assert loaded.hidden_size == model.config.hidden_size


def test_the_boundaries_read_the_token_embedding_from_the_folder(folders):
    cfg = config(model__name=str(folders["qwen2-sharded"]), mesh__pp=2)
    full = load(cfg).model
    disk = load_stage(cfg, 1).model
    assert torch.equal(disk.get_input_embeddings().weight, full.get_input_embeddings().weight)
    assert disk.get_input_embeddings().padding_idx == full.get_input_embeddings().padding_idx
    assert disk.config.vocab_size == full.config.vocab_size


def test_a_folder_missing_a_tensor_a_stage_needs_is_a_clear_error(folders, tmp_path):
    folder = save_folder("llama", tmp_path / "broken")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.3.mlp.up_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = config(model__name=str(folder), mesh__pp=2)
    load_stage(cfg, 0)  # stage 0 (layers 0-1) does not need it
    with pytest.raises(ConfigError, match=r"has no tensor 'model.layers.3.mlp.up_proj.weight', which stage 1 needs"):
        load_stage(cfg, 1)


DIST_CASES = {
    # tied embeddings kept in sync; MAPL reads the token embedding (from the file on a rank)
    "tied qwen2, MAPL": ("qwen2-sharded", ["--set", "boundary.kind=mapl", "--set", "boundary.rank=16"]),
    # adapters drawn per name on each rank; a masked boundary
    "llama + LoRA, mask": ("llama", ["--set", "train.lora.rank=4", "--set", "boundary.kind=mask",
                                     "--set", "train.lr=1e-2"]),
}


@pytest.mark.dist
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", list(DIST_CASES))
def test_dist_from_a_model_folder_equals_the_simulation_file_by_file(case, folders, tmp_path):
    family, extra = DIST_CASES[case]
    args = ["--set", f"model.name={folders[family]}", "--set", "data.name=synthetic", "--set", "train.steps=3",
            "--set", "train.batch_size=2", "--set", "train.seq_len=32", "--set", "train.microbatches=2",
            "--set", "train.checkpoint_every=0", "--set", "eval.every=2", "--set", "mesh.pp=2", *extra]
    assert main(["train", "--out", str(tmp_path / "sim"), "--quiet", *args]) == 0
    r = launch(2, tmp_path / "dist", args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run_files(tmp_path / "sim", tmp_path / "dist")
