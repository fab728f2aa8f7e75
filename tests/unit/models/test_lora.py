"""LoRA composition through peft (anchor-priors §6, Table 8)."""

import json

import pytest
import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.config import ConfigError
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.models.lora import adapter_seed, apply_lora, merge_lora

LORA = dict(train__lora__rank=4, train__lora__alpha=8.0)


def lora_model(seed=0, family="llama", **sets):
    model = tiny_model(family, seed)
    cfg = config(**{**LORA, **sets})
    return apply_lora(model, cfg.train.lora, cfg.train.seed)


def params(mesh):
    return {f"{st.index}.{n}": p.detach().clone() for st in mesh.replicas[0] for n, p in st.named_parameters()}


@pytest.mark.parametrize("family,tied", [("llama", "sync"), ("qwen2", "sync"), ("qwen2", "untie")])
def test_only_adapter_parameters_change_and_are_counted(family, tied):
    """Tied embeddings (qwen2) too: the last stage's copy of the head stays frozen like the
    embedding it copies (it once came out trainable, 28 M extra parameters on SmolLM2)."""
    cfg = config(model__name=f"tiny-{family}", mesh__pp=2, boundary__kind="mask", boundary__p=0.9,
                 train__batch_size=2, train__lr=1e-2, model__tied=tied, **LORA)
    mesh = SimMesh(lora_model(family=family), cfg)
    before = params(mesh)
    for step in range(2):
        mesh.train_step([tiny_batch(batch_size=2, seed=step)])
    after = params(mesh)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_B" in k or "lora_A" in k for k in changed)
    assert {k for k in before if "lora_" in k} == changed  # every adapter moved (B starts at 0)
    from thinpipe.engine.sim_engine import trainable_params

    n_adapters = sum(v.numel() for k, v in before.items() if "lora_" in k)
    assert trainable_params(mesh) == n_adapters
    # 4 layers x 7 linear maps, each r (in + out): a small fraction of the model
    assert n_adapters < 0.2 * sum(v.numel() for v in before.values())


def test_identity_boundaries_plus_lora_equal_plain_peft_training_on_the_unsplit_model():
    """Our split mesh (pp = 2, identity boundaries) with LoRA vs peft's get_peft_model + AdamW on the
    unsplit Hugging Face model: same adapters, same losses, for several steps."""
    from peft import LoraConfig, get_peft_model

    lr, steps = 1e-2, 3
    kw = dict(model__name="tiny-llama", mesh__pp=2, train__batch_size=2, train__lr=lr, train__steps=steps,
              train__grad_clip=0.0, train__warmup_ratio=0.0, train__min_lr_ratio=1.0, **LORA)
    ours = SimMesh(lora_model(), config(**kw))
    ref = get_peft_model(tiny_model("llama", 0), LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0,
                                                             target_modules=config(**LORA).train.lora.target_modules))
    trainable = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    ref_adapters = {n.replace("base_model.model.", ""): p for n, p in ref.named_parameters() if p.requires_grad}
    ours_adapters = {("lm_head." + n[8:] if n.startswith("lm_head.") else f"model.{n}"): p
                     for st in ours.replicas[0] for n, p in st.named_parameters() if p.requires_grad}
    assert ref_adapters.keys() == ours_adapters.keys()
    with torch.no_grad():  # the same start (ours is drawn per name: see the next test)
        for n in ref_adapters:
            ref_adapters[n].copy_(ours_adapters[n])
    for step in range(steps):
        batch = tiny_batch(batch_size=2, seed=step)
        batch["segment_ids"].zero_()  # one document per row: HF's plain causal mask applies
        loss_ours = ours.train_step([batch])
        opt.zero_grad()
        loss_ref = ref(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss_ref.backward()
        opt.step()
        assert loss_ours == pytest.approx(float(loss_ref.detach()), rel=1e-5)
    for n in ref_adapters:
        torch.testing.assert_close(ours_adapters[n], ref_adapters[n], rtol=1e-4, atol=1e-6)


def test_adapters_start_as_peft_draws_them_each_from_its_own_seed():
    """peft's own initialisation, run on the global RNG seeded with the adapter's seed, gives the
    values ``apply_lora`` gave; they depend on the name alone, not on which other modules have
    adapters (so a rank that builds one stage draws the same)."""
    model = lora_model(seed=0, train__seed=7)
    name = "model.layers.2.self_attn.q_proj"
    layer = model.get_submodule(name)
    ours_A, ours_B = layer.lora_A["default"].weight.detach().clone(), layer.lora_B["default"].weight.detach().clone()
    assert not torch.equal(ours_A, torch.zeros_like(ours_A)) and torch.equal(ours_B, torch.zeros_like(ours_B))
    torch.manual_seed(adapter_seed(7, f"{name}.lora_A.default.weight"))
    layer.reset_lora_parameters("default", True)  # peft: kaiming-uniform(a = sqrt 5) A, zero B
    assert torch.equal(layer.lora_A["default"].weight, ours_A)
    assert torch.equal(layer.lora_B["default"].weight, ours_B)
    only_q = apply_lora(tiny_model("llama", 0), config(**LORA, train__lora__target_modules=["q_proj"]).train.lora, 7)
    assert torch.equal(only_q.get_submodule(name).lora_A["default"].weight, ours_A)
    other = lora_model(seed=0, train__seed=8).get_submodule(name).lora_A["default"].weight
    assert not torch.equal(other, ours_A)  # the run seed matters
    plain = tiny_model("llama", 0)
    state = torch.random.get_rng_state()
    apply_lora(plain, config(**LORA).train.lora, 7)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left as it was


def test_lora_composes_with_masking_the_anchor_circuit_and_diloco():
    """The anchor pulls and pushes adapters only, DiLoCo syncs adapters only, the spectral filter
    acts on adapter gradients."""
    kw = dict(model__name="tiny-llama", mesh__pp=2, mesh__dp=2, mesh__anchor=1, boundary__kind="mask",
              boundary__p=0.9, anchor__staleness=1, anchor__every=1, dp__kind="diloco", dp__inner_steps=2,
              train__batch_size=2, train__lr=1e-2)
    full = SimMesh(tiny_model("llama"), config(**kw))
    lora = SimMesh(lora_model(), config(**kw, **LORA))
    for mesh in (full, lora):
        for step in range(4):
            mesh.train_step([tiny_batch(batch_size=2, seed=step)] * 2, tiny_batch(batch_size=2, seed=100 + step))
    n_full = sum(p.numel() for st in full.replicas[0] for p in st.parameters())
    n_lora = sum(p.numel() for st in lora.replicas[0] for p in st.parameters() if p.requires_grad)
    assert lora.priors_consumed == full.priors_consumed == 3
    # bytes: the anchor's pull and DiLoCo's sync scale with what trains; PP traffic does not change
    assert lora.meter.totals["pp_fwd"] == full.meter.totals["pp_fwd"]
    assert lora.meter.totals["dp"] / full.meter.totals["dp"] == pytest.approx(n_lora / n_full, rel=0.05)
    assert lora.meter.totals["anchor"] < 0.5 * full.meter.totals["anchor"]
    opt = lora.ranks[0][0].optimizer
    assert opt.basis and all("lora_" in n for n in opt.basis)  # the filter acts on adapter matrices


@pytest.mark.slow
def test_train_reports_trainable_params_and_export_merges_adapters(tmp_path):
    from transformers import AutoModelForCausalLM

    from thinpipe.cli import main

    run = tmp_path / "run"
    sets = ["model.name=tiny-llama", "data.name=synthetic", "mesh.pp=2", "train.steps=2", "train.batch_size=2",
            "train.seq_len=32", "data.val_rows=4", "train.lr=1e-2", "train.lora.rank=4"]
    assert main(["train", "--out", str(run), "--quiet", *[x for s in sets for x in ("--set", s)]]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert 0 < summary["trainable_params"] < 100_000
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not any("lora" in n for n, _ in hf.named_parameters())
    # the exported plain model computes what the trained mesh computes
    from thinpipe.engine.run_folder import load_mesh

    _, mesh, _ = load_mesh(run)
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        want = mesh.logits(ids, torch.ones_like(ids))
        got = hf(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_lora_save_adapter_ends_the_job_with_peft_s_adapter_of_its_base_folder(tmp_path, capsys):
    """train.lora.save = adapter: OUT/model/ is peft's adapter (no model weights) naming the base model's folder;
    PeftModel.from_pretrained on that base computes what the trained mesh computes; export writes the same adapter
    or, with --lora-save merged, the plain model. A random preset has no base folder to name: one line."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from thinpipe.cli import main
    from thinpipe.engine.run_folder import load_mesh
    from thinpipe.models.loading import load_model

    base, run = tmp_path / "base", tmp_path / "run"
    loaded = load_model("tiny-llama")
    loaded.model.save_pretrained(base)
    loaded.tokenizer.save_pretrained(base)
    sets = [f"model.name={base}", "data.name=synthetic", "mesh.pp=2", "train.steps=2", "train.batch_size=2",
            "train.seq_len=32", "data.val_rows=4", "train.lr=1e-2", "train.lora.rank=4", "train.lora.save=adapter"]
    assert main(["train", "--out", str(run), "--quiet", *[x for s in sets for x in ("--set", s)]]) == 0
    assert json.loads((run / "summary.json").read_text())["model_format"] == "peft"
    files = {p.name for p in (run / "model").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    assert json.loads((run / "model" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    adapter = load_file(run / "model" / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.model.layers.") for k in adapter)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items())  # trained: B left zero
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / "model")
    _, mesh, _ = load_mesh(run)
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        want = mesh.logits(ids, torch.ones_like(ids))
        got = peft(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "a")]) == 0
    again = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert again.keys() == adapter.keys() and all(torch.equal(again[k], adapter[k]) for k in adapter)
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "m"), "--lora-save", "merged"]) == 0
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")(input_ids=ids).logits
    torch.testing.assert_close(merged, want, rtol=1e-4, atol=1e-4)
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "r2"), "--quiet", "--set", "model.name=tiny-llama",
                 "--set", "train.lora.rank=4", "--set", "train.lora.save=adapter"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "random preset" in err[0], err


def test_merge_lora_folds_the_adapter_update():
    model = lora_model()
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        merged = merge_lora(model)
        after = merged(input_ids=ids).logits
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_bad_lora_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="train.lora needs rank >= 0"):
        config(train__lora__rank=-1)
    with pytest.raises(ConfigError, match="train.lora.save must be merged or adapter"):
        config(train__lora__save="peft")
    with pytest.raises(ConfigError, match="train.lora.rank = 0 trains none"):
        config(train__lora__save="adapter")
    with pytest.raises(ConfigError, match="train.model_rank = 4 is not a rank of this job"):
        config(train__model_rank=4, mesh__pp=2, mesh__dp=2)
    with pytest.raises(ValueError, match="not modules of this model"):
        lora_model(train__lora__target_modules=["c_attn"])
