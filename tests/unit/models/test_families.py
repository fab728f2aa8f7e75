"""Every supported model family split into stages equals transformers' own model (models/families.py).

Tiny random models of each family (tests/family_configs.py: 4 layers, hidden 64, a 4-token sliding
window, each family's head transform and multipliers switched on) against the unsplit Hugging Face model
in fp32: logits bitwise, the loss and every parameter's gradient, two packed documents equal to each
alone, greedy generation through the mesh's KV cache equal to ``generate``, perplexity through the mesh's
held-out pass; a refused family is one line, exit 2; docs/models.md lists what the registry holds."""

import json
import re
from pathlib import Path

import pytest
import torch

from tests.family_configs import FAMILY_KEYS, VARIANTS, family_config, family_folder, family_model
from tests.helpers import config
from tests.unit.engine.test_generation import GREEDY, PROMPTS, TOK, hf_generate
from thinpipe.cli import main
from thinpipe.config import ConfigError
from thinpipe.engine.sim_generate import generate_on_mesh
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.models import build_stages
from thinpipe.models.families import FAMILIES, REFUSED, ROUTER_GATES, Family, family_of
from thinpipe.models.lora import apply_lora
from thinpipe.models.packed_attention import Documents
from thinpipe.models.stages import balanced_split
from thinpipe.rank.context import MicrobatchContext, positions_and_mask

DOCS = Path(__file__).resolve().parents[3] / "docs" / "models.md"
CASES = [*FAMILY_KEYS, *VARIANTS]  # every family, and a family with an optional feature off
# families whose tiny config has something outside the layers a Llama-layout stage would miss
SPECIAL = ["mistral", "qwen2", "gemma2", "gemma3_text", "granite", "cohere", "cohere2", "smollm3", "exaone4",
           "ministral", "olmo3", "starcoder2", "granitemoe", "mixtral", "gpt_oss"]


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = family_model(family)
        return cache[family]

    return get


def batch_of(ids: torch.Tensor, seg: torch.Tensor | None = None) -> dict:
    seg = torch.zeros_like(ids) if seg is None else seg
    labels = ids.clone()
    labels[:, :2] = -100  # an unlabelled prompt
    return {"input_ids": ids, "labels": labels, "segment_ids": seg}


def ids_of(rows: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (rows, t), generator=torch.Generator().manual_seed(seed))


def stage_logits(stages, ids: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    pos, mask = positions_and_mask(seg)
    ctx = MicrobatchContext(0, 0, 0, ids, torch.full_like(ids, -100), pos, mask, 1.0)
    x = ids
    with torch.no_grad():
        for st in stages:
            x = st.hidden_states(x, ctx)
        return stages[-1].logits(x)


def same_kernel(model) -> bool:
    """Whether transformers' model and the stages attend with one kernel: SDPA both (the stages' packed attention
    is SDPA underneath), or eager both (an option only eager honours)."""
    family = family_of(model.config)
    return family.attn_implementation(model.config) == "sdpa" or not family.packs(model.config)


def hf_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def mesh_grads(mesh) -> dict:
    out = {}
    for st in mesh.replicas[0]:
        names = st.family.layout
        for name, p in st.named_parameters():
            if p.grad is None:
                continue
            key = st.hf_name(name)
            if key == names.head_weight and st.tied_embeddings:
                key = names.embedding_weight  # the last stage's copy of the tied matrix: the engine sums them
            out[key] = out[key] + p.grad if key in out else p.grad.clone()
    return out


def decoder_layers(model):
    names = family_of(model.config).layout
    return getattr(getattr(model, names.decoder), names.layers)


def reference_loss(model, ids, labels, pp: int):
    """(the token-mean next-token loss, the router loss a ``pp``-stage split trains with or None, their sum as the
    split trains on) of the unsplit transformers model: each stage's ``load_balancing_loss_func`` of its layers'
    router logits as transformers returns them, weighted by its share of the layers (models/router_loss.py); with one
    stage, transformers' own ``aux_loss``."""
    import sys

    c = model.config
    out = model(input_ids=ids, labels=labels, output_router_logits=bool(getattr(c, "output_router_logits", False)))
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    logits = getattr(out, "router_logits", None)
    if not logits:
        return ce, None, ce
    fn = sys.modules[type(model).__module__].load_balancing_loss_func
    assert len(logits) == c.num_hidden_layers  # every layer of these configs routes
    aux, start = 0.0, 0
    for n in balanced_split(c.num_hidden_layers, pp):
        aux = aux + fn(tuple(logits[start:start + n]), model.num_experts, model.num_experts_per_tok, None) * (
            n / c.num_hidden_layers)
        start += n
    if pp == 1:
        torch.testing.assert_close(aux, out.aux_loss)
    return ce, aux, ce + model.router_aux_loss_coef * aux


def test_every_registered_family_has_a_tiny_config_here():
    assert set(FAMILY_KEYS) == set(FAMILIES)


@pytest.mark.parametrize("family", CASES)
def test_logits_loss_and_gradients_equal_transformers(family, models):
    """A mixture of experts trains with its router loss (``output_router_logits``): every gradient equals the unsplit
    model's of the next-token loss plus ``router_aux_loss_coef`` times each stage's load-balancing loss
    (``reference_loss``); the loss returned is the next-token loss, the router loss is reported beside it."""
    model = models(family)
    ids = ids_of(2, 12)  # 12 tokens: three times the sliding window
    batch = batch_of(ids)
    with torch.no_grad():
        ref_logits = model(input_ids=ids).logits
    for pp in (2, 3):
        model.zero_grad()
        ce, aux, total = reference_loss(model, ids, batch["labels"], pp)
        total.backward()
        want = hf_grads(model)
        model.zero_grad()
        mesh = SimMesh(model, config(model__name="tiny-llama", mesh__pp=pp, train__batch_size=2))
        logits = mesh.logits(ids, torch.ones_like(ids))
        if same_kernel(model):
            assert torch.equal(logits, ref_logits), f"{family} pp={pp}: logits"
        else:  # eager in transformers (its class has no SDPA), SDPA in the stages: equal to rounding
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        loss = mesh.forward_backward([batch])
        torch.testing.assert_close(torch.tensor(loss), ce.detach(), rtol=1e-6, atol=1e-6)
        router = sum(st.take_router_aux() for st in mesh.replicas[0])
        if aux is not None:
            assert router == pytest.approx(float(aux.detach()), rel=1e-5), f"{family} pp={pp}: router loss"
        got = mesh_grads(mesh)
        assert got.keys() == want.keys(), family
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{family} {name}: {m}")


@pytest.mark.parametrize("family", CASES)
def test_two_packed_documents_equal_each_alone(family, models):
    model = models(family)
    a, b = ids_of(1, 7, seed=1), ids_of(1, 9, seed=2)  # both longer than the window
    seg = torch.tensor([[0] * 7 + [1] * 9])
    packed = stage_logits(build_stages(model, None, 2), torch.cat([a, b], dim=1), seg)
    with torch.no_grad():
        alone_a, alone_b = model(input_ids=a).logits, model(input_ids=b).logits
    torch.testing.assert_close(packed[:, :7], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 7:], alone_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", CASES)
def test_packed_attention_equals_the_dense_mask_path(family, models):
    """model.attention = packed (each document's causal attention, windows as query blocks; no T x T mask) against
    the dense mask (the path before issue 51): 2 stages, two packed documents and one longer than the window in a
    row beside an unpacked one: loss 1e-6, every gradient 1e-5 (fp32). Gemma 2 runs eager either way."""
    model = models(family)
    ids = ids_of(2, 14, seed=3)
    seg = torch.tensor([[0] * 6 + [1] * 8, [0] * 14])
    out = {}
    for attention in ("mask", "packed"):
        mesh = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2, train__batch_size=2,
                                     model__attention=attention))
        masks = mesh.replicas[0][0].layer_masks(positions_and_mask(seg)[1])
        packs = family_of(model.config).packs(model.config)
        assert all(isinstance(m, Documents) for m in masks.values()) == (attention == "packed" and packs)
        loss = mesh.forward_backward([batch_of(ids, seg)])
        out[attention] = loss, mesh_grads(mesh), mesh.logits(ids, torch.ones_like(ids))
    torch.testing.assert_close(torch.tensor(out["packed"][0]), torch.tensor(out["mask"][0]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out["packed"][2], out["mask"][2], rtol=1e-5, atol=1e-5)
    for name, g in out["mask"][1].items():
        torch.testing.assert_close(out["packed"][1][name], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", SPECIAL)
def test_the_tiny_configs_exercise_what_the_family_adds(family, models):
    """Not vacuous: a stage that ignored the family (the Llama layout: full attention, no multiplier, no head
    transform; Gemma 3's rotary per layer type kept, which its rotary module needs) computes other logits for
    each of these configs."""
    model = models(family)
    ids, seg = ids_of(1, 12), torch.zeros(1, 12, dtype=torch.long)
    stages = build_stages(model, None, 2)
    exact = stage_logits(stages, ids, seg)
    for st in stages:
        st.family = Family(family, rotary_per_layer_type=FAMILIES[family].rotary_per_layer_type,
                           layout=FAMILIES[family].layout)
        st.layer_types, st.windows = ["full_attention"] * len(st.layers), [None] * len(st.layers)
        st.embed_scale = None
    assert (stage_logits(stages, ids, seg) - exact).abs().max() > 1e-3


@pytest.mark.parametrize("family, pp", [(f, 2) for f in CASES] + [("gemma3_text", 3), ("cohere2", 3),
                                                                          ("mistral", 3), ("granite", 3)])
def test_greedy_generation_through_the_kv_cache_equals_generate(family, pp, models):
    model = models(family)
    if getattr(model.config, "output_router_logits", False):  # transformers' generate fails with it on (its router
        model = family_model(family, output_router_logits=False)  # loss of a decode step); the same weights
    mesh = SimMesh(model, config(model__name="tiny-llama", mesh__pp=pp))
    got = generate_on_mesh(mesh, PROMPTS, GREEDY, TOK)  # prompts of 2 to 33 tokens: past the window, left-padded
    assert got == hf_generate(model, PROMPTS, 12, TOK.pad_token_id)


def test_a_sliding_layer_sees_only_its_window():
    """The window is transformers' ``kv_idx > q_idx - window`` over the mask's columns, also for the
    queries of a decode step (the last columns)."""
    from thinpipe.models.families import sliding_window_mask

    full = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    got = sliding_window_mask(full, 3)[0, 0].int()
    want = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0],
                         [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]])
    assert torch.equal(got, want)
    step = sliding_window_mask(torch.ones(1, 1, 1, 6, dtype=torch.bool), 3)[0, 0, 0].int()
    assert step.tolist() == [0, 0, 0, 1, 1, 1]


def test_eager_attention_is_chosen_where_only_it_is_exact():
    """Gemma 2's attention soft-cap: eager, no packing. Without it the stages pack, but the model is built eager:
    transformers' Gemma 2 class has no SDPA path (asking for it was issue 53's crash)."""
    on, off = family_config("gemma2"), family_config("gemma2", attn_logit_softcapping=None)
    assert family_of(on).attn_implementation(on) == "eager" and not family_of(on).packs(on)
    assert family_of(off).attn_implementation(off) == "eager" and family_of(off).packs(off)
    llama = family_config("llama")
    assert family_of(llama).attn_implementation(llama) == "sdpa" and family_of(llama).packs(llama)
    stages = build_stages(family_model("gemma2 without soft-caps"), None, 2)
    assert all(st.model_config._attn_implementation == "thinpipe_packed" for st in stages)


@pytest.mark.parametrize("family", list(FAMILY_KEYS))
def test_lora_default_targets_are_every_linear_map_of_a_decoder_layer(family, models):
    from thinpipe.config.train import LoraConfig

    linear = {n.rsplit(".", 1)[-1] for n, m in decoder_layers(models(family))[0].named_modules()
              if isinstance(m, torch.nn.Linear)}
    assert set(FAMILIES[family].lora_targets) == linear - set(ROUTER_GATES)
    if family == "phi3":  # the fused projections get adapters by default
        lora_model = apply_lora(family_model("phi3"), LoraConfig(rank=2))
        names = {n for n, p in lora_model.named_parameters() if p.requires_grad}
        assert any(".qkv_proj.lora_A" in n for n in names) and any(".gate_up_proj.lora_B" in n for n in names)


def test_an_option_the_seam_cannot_honour_is_refused():
    with pytest.raises(ConfigError, match="gemma3_text with use_bidirectional_attention"):
        family_of(family_config("gemma3_text", use_bidirectional_attention=True))
    with pytest.raises(ConfigError, match="falcon with alibi = true"):
        family_of(family_config("falcon", alibi=True))


def test_docs_list_the_registry():
    text = DOCS.read_text()
    supported = set(re.findall(r"^\| `([a-z0-9_]+)` \| supported", text, re.M))
    refused = set(re.findall(r"^\| `([a-z0-9_]+)` \| refused", text, re.M))
    assert supported == set(FAMILIES), "docs/models.md and models/families.py disagree on the supported families"
    assert refused == set(REFUSED), "docs/models.md and models/families.py disagree on the refused families"


@pytest.mark.parametrize("family", sorted(REFUSED))
@pytest.mark.parametrize("command", ["train", "generate", "eval"])
def test_a_refused_family_is_one_line_exit_2(family, command, tmp_path, capsys):
    from transformers import AutoConfig

    folder = tmp_path / family
    AutoConfig.for_model(family, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=512).save_pretrained(folder)  # a config alone: refused before any weight
    args = {"train": ["train", "--set", f"model.name={folder}", "--out", str(tmp_path / "run")],
            "generate": ["generate", "--model", str(folder), "--prompt", "hi"],
            "eval": ["eval", "--model", str(folder), "--tasks", "arc_easy"]}[command]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model family '{family}' is not supported" in err[0], err


def hf_nll(model, texts) -> tuple[float, int]:
    """Summed next-token NLL of each text alone through the unsplit model, and the tokens scored."""
    total, n = 0.0, 0
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([TOK.encode(t)])
            logp = model(input_ids=ids).logits.float().log_softmax(-1)
            total += float(-logp[0, :-1].gather(1, ids[0, 1:, None]).sum())
            n += ids.shape[1] - 1
    return total, n


TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hi", "Sliding windows see four tokens back."]


@pytest.mark.parametrize("family", CASES)
def test_eval_perplexity_through_the_mesh_equals_transformers(family, tmp_path, capsys):
    folder = family_folder(family, tmp_path / "model")
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert main(["eval", "--model", str(folder), "--perplexity", str(data), "--set", "mesh.pp=2", "--json",
                 "--batch-size", "2"]) == 0
    got = json.loads(capsys.readouterr().out)  # stdout holds exactly one JSON object
    want, n = hf_nll(family_model(family), TEXTS)
    assert got["tokens"] == n and got["pp"] == 2 and got["rows"] == 3
    assert got["nll_sum"] == pytest.approx(want, rel=1e-5)


def write_gguf(path, architecture: str):
    """A GGUF file with its architecture and one tensor: what the family check reads (metadata only)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), architecture)
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_file_is_checked_by_its_architecture_before_conversion(tmp_path, capsys):
    from thinpipe.models.loading import gguf_model_type, resolve_model_name

    gemma3 = write_gguf(tmp_path / "g3.gguf", "gemma3")
    assert gguf_model_type(gemma3) == "gemma3_text" and resolve_model_name(str(gemma3)) == str(gemma3)
    gpt2 = write_gguf(tmp_path / "g.gguf", "gpt2")
    assert main(["generate", "--model", str(gpt2), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model family 'gpt2' is not supported" in err[0]
