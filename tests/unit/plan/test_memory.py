"""``thinpipe plan``'s memory per rank (plan/memory.py, issue 51): its parts checked against what they count (a
real stage's parameters, the schedule's microbatches in flight, a real stage's saved activations), and the command's
``memory.ranks`` and ``--memory-gb``. The prediction against measured peaks: benchmarks/memory_prediction.py."""

import json

import pytest
import torch

from thinpipe.cli import main
from thinpipe.config import load_config
from thinpipe.models import build_stages, load_model
from thinpipe.models.lora import apply_lora
from thinpipe.plan.memory import GIB, fit, in_flight, layer_activations, predict
from thinpipe.plan.planner import ARCHITECTURES
from thinpipe.rank.context import positions_and_mask
from thinpipe.rank.from_config import configure_stage


def test_microbatches_in_flight_follow_the_schedules():
    """1F1B: stage s of K holds min(K - s, M) (its warm-up plus the one in steady state); GPipe all M."""
    assert in_flight("1f1b", 4, 2) == [2, 2, 2, 1]
    assert in_flight("1f1b", 4, 8) == [4, 3, 2, 1]
    assert in_flight("gpipe", 3, 5) == [5, 5, 5]


@pytest.mark.parametrize("sets", [["mesh.pp=3"], ["mesh.pp=2", "train.lora.rank=4"], ["mesh.pp=1"],
                                  ["mesh.pp=2", "mesh.split=[1, 3]"]])
def test_stage_parameters_are_those_of_the_real_stages(sets):
    """Weights (and LoRA's adapters) per stage equal the parameters of the stages ``build_stages`` carves; what
    trains equals what requires a gradient."""
    cfg = load_config(None, ["model.name=tiny-llama", *sets])
    model = load_model("tiny-llama").model
    apply_lora(model, cfg.train.lora, 0)
    stages = build_stages(model, cfg.mesh.split or None, cfg.mesh.pp)
    ranks = predict(cfg, ARCHITECTURES["tiny-llama"])["ranks"]
    for st, r in zip(stages, ranks):
        assert r["parts_bytes"]["weights"] == 4 * sum(p.numel() for p in st.parameters())
        assert r["trained_params"] == sum(p.numel() for p in st.parameters() if p.requires_grad)
        assert r["parts_bytes"]["optimizer"] == 8 * r["trained_params"]  # AdamW's two fp32 moments


def _stage_saved_bytes(cfg, tokens: int) -> int:
    """What a real middle stage of 2 layers keeps for its backward (distinct storages, parameters excluded) on one
    row of ``tokens`` tokens packed with 4 documents."""
    model = load_model("small-llama").model
    apply_lora(model, cfg.train.lora, 0)
    stage = configure_stage(build_stages(model, [3, 2, 3], 3)[1], cfg).train()
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    kept: dict[int, int] = {}

    def keep(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    pos, docs = positions_and_mask((torch.arange(tokens) * 4 // tokens)[None])
    ctx = type("Ctx", (), {"position_ids": pos, "attn_mask": docs})()
    x = torch.randn(1, tokens, model.config.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = stage(x, ctx)
    out.sum().backward()
    return sum(kept.values())


@pytest.mark.parametrize("sets", [[], ["train.lora.rank=8"], ["train.activation_checkpointing=true"]])
def test_layer_activations_extrapolate_to_a_real_stage_at_another_length(sets):
    """The line measured on one layer at 64 and 128 tokens predicts what a 2-layer stage keeps at 1,000 tokens
    (another stage, another length): within 2% (with checkpointing: the layers' inputs alone); a layer's forward
    allocates more than it keeps."""
    cfg = load_config(None, ["model.name=small-llama", *sets])
    act = layer_activations(cfg, ARCHITECTURES["small-llama"])
    want = _stage_saved_bytes(cfg, 1000)
    per_layer = act.input.at(1000) if cfg.train.activation_checkpointing else act.saved.at(1000)
    assert 2 * per_layer == pytest.approx(want, rel=0.02)
    assert act.resident(1000, cpu=True, trimmed=False) > act.resident(1000, cpu=True) == act.saved.at(1000)
    assert act.saved.at(1000) > act.input.at(1000) == 1000 * 128 * 4


def test_checkpointing_and_more_microbatches_lower_the_activations_alone():
    cfg = load_config(None, ["model.name=llama-150m", "train.seq_len=1024", "train.batch_size=4"])
    arch = ARCHITECTURES["llama-150m"]
    plain, ckpt = predict(cfg, arch)["ranks"][0], predict(cfg, arch, checkpointing=True)["ranks"][0]
    assert ckpt["parts_bytes"]["activations"] < plain["parts_bytes"]["activations"] / 10
    assert {k: v for k, v in ckpt["parts_bytes"].items() if k not in ("activations", "transient")} == \
        {k: v for k, v in plain["parts_bytes"].items() if k not in ("activations", "transient")}
    assert predict(cfg, arch, microbatches=4)["ranks"][0]["peak_bytes"] < plain["peak_bytes"]


def test_the_writer_of_the_jobs_model_holds_all_of_it_at_the_end():
    """On the CPU the writer's end peak holds the whole model, every other rank its share's copy for the wire; on a
    GPU that is host memory, reported apart from the device's peak."""
    sets = ["model.name=llama-500m", "mesh.pp=4", "train.seq_len=64", "train.batch_size=1", "train.lora.rank=16"]
    arch = ARCHITECTURES["llama-500m"]
    ranks = predict(load_config(None, sets), arch)["ranks"]
    assert ranks[0]["end_peak_bytes"] > 4 * arch.params  # the whole model's fp32 weights
    for r in ranks:
        assert r["peak_bytes"] == max(r["end_peak_bytes"], r["training_peak_bytes"])
        if r["stage"]:  # the stage's weights, and its share once more
            assert r["end_peak_bytes"] - r["parts_bytes"]["weights"] - r["parts_bytes"]["optimizer"] \
                - r["parts_bytes"]["floor"] == 4 * r["params"]
    gpu = predict(load_config(None, sets), arch, "h100")["ranks"]
    assert all("end_peak_bytes" not in r and r["peak_bytes"] == r["training_peak_bytes"] for r in gpu)
    assert gpu[0]["end_host_bytes"] > 4 * arch.params


def test_plan_memory_json_and_the_cheapest_change_that_fits(capsys):
    """``--json`` carries ``memory.ranks`` (``stage``, ``peak_bytes``); ``--memory-gb`` below the peak names a change
    whose own prediction fits, above it says every rank fits; a limit nothing reaches exits 1."""
    base = ["plan", "--device", "cpu", "--set", "model.name=llama-150m", "--set", "train.seq_len=2048",
            "--set", "link.pp_mbps=200", "--json"]
    assert main(base) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert [r["stage"] for r in memory["ranks"]] == [0] and memory["ranks"][0]["peak_bytes"] > GIB
    peak = memory["ranks"][0]["peak_bytes"] / GIB
    assert main([*base, "--memory-gb", str(peak * 0.7)]) == 0
    f = json.loads(capsys.readouterr().out)["memory"]["fit"]
    assert not f["fits"] and f["change"] and f["largest_peak_bytes"] <= 0.7 * peak * GIB
    cfg = load_config(None, ["model.name=llama-150m", "train.seq_len=2048", *(f"{k}={v}" for k, v in
                                                                             f["settings"].items())])
    assert predict(cfg, ARCHITECTURES["llama-150m"])["largest_peak_bytes"] == f["largest_peak_bytes"]
    assert fit(load_config(None, ["model.name=llama-150m", "train.seq_len=2048"]), ARCHITECTURES["llama-150m"],
               "cpu", peak * 1.01)["fits"]
    assert main([*base, "--memory-gb", "0.5"]) == 1
    assert json.loads(capsys.readouterr().out)["memory"]["fit"]["change"] is None
    assert main([*base[:-1], "--memory-gb", "-1"]) == 2
    assert "--memory-gb must be > 0" in capsys.readouterr().err


def test_a_cpu_stage_trims_the_heap_after_each_layers_forward(monkeypatch):
    """``train.cpu_heap_trim`` (models/heap.py): a trim after each decoder layer's forward and backward on a CPU
    stage, none when off; the numbers are the same either way."""
    import thinpipe.models.stages as stages_module

    calls = []
    monkeypatch.setattr(stages_module, "release_freed_heap", lambda: calls.append(1))
    monkeypatch.setattr(stages_module, "TRIM_MIN_BYTES", 0)  # this stage's 8 KB activations trim too
    model = load_model("small-llama").model
    pos, docs = positions_and_mask(torch.zeros(1, 16, dtype=torch.long))
    ctx = type("Ctx", (), {"position_ids": pos, "attn_mask": docs})()
    outs, grads = [], []
    for on in (True, False):
        cfg = load_config(None, [f"train.cpu_heap_trim={str(on).lower()}"])
        stage = configure_stage(build_stages(model, [3, 2, 3], 3)[1], cfg)
        x = torch.randn(1, 16, 128, generator=torch.Generator().manual_seed(0), requires_grad=True)
        calls.clear()
        outs.append(stage(x, ctx))
        assert len(calls) == 2 * on  # after each of the stage's two layers' forwards, and nothing when off
        outs[-1].square().sum().backward()
        grads.append(x.grad)
        assert len(calls) == 4 * on  # and after each of their backwards
    assert torch.equal(*outs) and torch.equal(*grads)
