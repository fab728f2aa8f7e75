"""The MAPL paper's model scales (App. E.1) as presets, each rank building only its own stage
(models/scale_init.py): every parameter is its own seeded draw, so a stage built alone equals the whole model
carved, for every split, LoRA included; the shapes are App. E.1's; the BPE tokenizer's special ids are LLaMA's."""

import pytest
import torch
from transformers import LlamaConfig

from tests.helpers import config
from thinpipe.config import ConfigError
from thinpipe.config.train import LoraConfig
from thinpipe.data.bpe_tokenizer import SPECIAL, train_bpe
from thinpipe.models.lora import apply_lora
from thinpipe.models.presets import SCALES, scale_config
from thinpipe.models.scale_init import ScaleModelOnDisk, initial_value, scale_model, scale_stages
from thinpipe.models.stage_loading import empty_model
from thinpipe.models.stages import build_stages

TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=4, tie_word_embeddings=False, initializer_range=0.02)


def state(stage):
    return {n: t for n, t in stage.state_dict().items() if not t.is_meta}


@pytest.mark.parametrize("lora", [LoraConfig(), LoraConfig(rank=4)])
def test_a_stage_built_alone_equals_the_whole_model_carved_for_every_split(lora):
    whole = apply_lora(scale_model(TINY, seed=7), lora, 7)
    union = {}
    for pp in (1, 2, 4):
        carved = build_stages(whole, None, pp)
        for i in range(pp):
            alone = scale_stages(TINY, i, None, pp, lora, 7)[i]
            a, b = state(alone), state(carved[i])
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (pp, i)
            union.update(a) if pp == 4 else None
    one = state(build_stages(whole, None, 1)[0])
    assert union.keys() == one.keys() and all(torch.equal(union[k], one[k]) for k in one)


def test_each_parameter_is_its_own_draw_with_llamas_distribution():
    a = initial_value("model.layers.3.mlp.up_proj.weight", (256, 64), torch.float32, 0, 0.02)
    assert torch.equal(a, initial_value("model.layers.3.mlp.up_proj.weight", (256, 64), torch.float32, 0, 0.02))
    assert not torch.equal(a, initial_value("model.layers.2.mlp.up_proj.weight", (256, 64), torch.float32, 0, 0.02))
    assert not torch.equal(a, initial_value("model.layers.3.mlp.up_proj.weight", (256, 64), torch.float32, 1, 0.02))
    assert abs(float(a.std()) - 0.02) < 0.001 and abs(float(a.mean())) < 0.001
    assert torch.equal(initial_value("model.norm.weight", (64,), torch.float32, 0, 0.02), torch.ones(64))
    # what a MAPL / SSN boundary reads on a rank without the embedding stage is the embedding stage's draw
    emb = ScaleModelOnDisk(TINY, 7).get_input_embeddings().weight
    assert torch.equal(emb, scale_model(TINY, 7).get_input_embeddings().weight)


@pytest.mark.parametrize("name", list(SCALES))
def test_the_scale_presets_have_app_e1_shapes(name):
    hidden, layers, heads, ffn = SCALES[name]
    c = scale_config(name)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (hidden, layers, heads,
                                                                                                ffn)
    assert c.vocab_size == 32_000 and c.max_position_embeddings == 2048 and not c.tie_word_embeddings
    n = sum(p.numel() for p in empty_model(c).parameters())  # meta: no memory
    # embedding + head, per layer q k v o and gate up down, two norms per layer and the last one
    assert n == 2 * 32_000 * hidden + layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) + hidden


def test_the_bpe_keeps_llamas_special_ids_and_round_trips(monkeypatch):
    # tokenizers' Rust thread pool would stay alive in this test worker for the tests after it: train on one thread
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")
    tok = train_bpe(["The quick brown fox jumps over the lazy dog. 12 + 30 = 42"] * 50, 300)
    assert [tok.token_to_id(s) for s in SPECIAL] == [0, 1, 2, 3]
    text = "the lazy fox: 12 + 30 = 42"
    assert tok.decode(tok.encode(text).ids) == text


def test_model_tokenizer_applies_to_scale_presets_only():
    with pytest.raises(ConfigError, match="applies to the random scale presets"):
        config(model__name="tiny-llama", model__tokenizer="/some/tokenizer")


@pytest.mark.dist
@pytest.mark.slow
def test_llama_150m_on_two_ranks_equals_the_simulation_and_records_its_params(tmp_path, one_thread):  # noqa: F811
    """The smallest scale preset at its real shape (and its 32k BPE, trained on first use): each rank draws only
    its own stage, and the two-rank job equals the simulation bitwise; summary.json records the model's size."""
    import json

    from tests.integration.test_dist import launch
    from thinpipe.cli import main

    args = ["--set", "model.name=llama-150m", "--set", "data.name=synthetic", "--set", "data.max_examples=64",
            "--set", "mesh.pp=2", "--set", "train.steps=2", "--set", "train.batch_size=1", "--set", "train.seq_len=32",
            "--set", "train.lr=1e-4", "--set", "train.checkpoint_every=0", "--set", "data.val_rows=2"]
    assert main(["train", "--out", str(tmp_path / "sim"), "--quiet", *args]) == 0
    r = launch(2, tmp_path / "dist", args)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = ([{k: v for k, v in json.loads(x).items() if k != "wall_s"}
             for x in (f / "metrics.jsonl").read_text().splitlines()] for f in (tmp_path / "sim", tmp_path / "dist"))
    assert a == b
    for f in ("sim", "dist"):
        assert json.loads((tmp_path / f / "summary.json").read_text())["params"] == 177_622_016
