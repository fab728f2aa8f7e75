"""LoRA composition (anchor-priors §6, Table 8) through ``peft``: adapters are injected into the
Hugging Face model *before* it is carved into stages, so every stage, boundary kind, DP scheme and
the anchor circuit see an ordinary model whose only trainable parameters are the adapters.

What changes downstream, and why it is right: optimisers, clipping, DP (all-reduce, PowerSGD,
DiLoCo's pseudo-gradients) and the anchor's pull and push act on parameters that train, so with
LoRA they carry adapters only (the frozen base is identical everywhere: every process loads the
same seeded weights); the spectral filter then acts on the adapter matrices' gradients. PP traffic
is unchanged: LoRA does not shrink activations (the paper's point in §6). For export and evaluation
``merge_lora`` folds B A x alpha / r into the base weights and drops the adapter modules, leaving a
plain Hugging Face model.

Adapters start from peft's default distribution, but each parameter is drawn from a generator
seeded by (run seed, its name) (``adapter_init``), so that a distributed rank that builds only its
own stage holds exactly the adapters the whole model would have.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from thinpipe.config import LORA_TARGETS
from thinpipe.models.families import family_of


def adapter_seed(seed: int, name: str) -> int:
    """The seed of one adapter parameter's initial draw: a stable hash of (run seed, its name in the
    Hugging Face model), the same in every process and Python session."""
    digest = hashlib.sha256(f"thinpipe-lora/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def adapter_init(name: str, shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The initial value of adapter parameter ``name`` (its Hugging Face name, e.g.
    ``model.layers.3.self_attn.q_proj.lora_A.default.weight``): peft's distribution, drawn from a
    generator of its own (``adapter_seed``).

    Why not peft's own draw: peft draws every lora_A from the global RNG in module order, so an
    adapter's value depends on every adapter built before it; a distributed rank that builds only
    its own stage (``models/stage_loading.py``) could not reproduce it. Drawn per name, the value is
    the same whichever layers a process materializes, in whatever order. Distribution as peft's
    default (``init_lora_weights=True``): lora_A kaiming-uniform (a = sqrt 5), lora_B zeros;
    embedding adapters: A zeros, B standard normal."""
    g = torch.Generator().manual_seed(adapter_seed(seed, name))
    t = torch.empty(shape, dtype=dtype)
    kind = next((k for k in ("lora_embedding_A", "lora_embedding_B", "lora_A", "lora_B") if f".{k}." in f".{name}"),
                None)
    if kind == "lora_A":
        return nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
    if kind == "lora_embedding_B":
        return nn.init.normal_(t, generator=g)
    if kind in ("lora_B", "lora_embedding_A"):
        return nn.init.zeros_(t)
    raise ValueError(f"{name}: not a LoRA adapter parameter thinpipe knows how to initialise")


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Set every adapter parameter of ``model`` (a whole Hugging Face model: its parameter names are
    the Hugging Face names) to ``adapter_init``. Parameters on the meta device are left for whoever
    materializes them (``stage_loading.py`` calls ``adapter_init`` by name)."""
    for name, p in model.named_parameters():
        if "lora_" in name and not p.is_meta:
            p.copy_(adapter_init(name, p.shape, p.dtype, seed))


def default_targets(config, requested) -> list[str]:
    """The modules that get adapters: ``requested``, except that the default (every linear map of a Llama
    decoder layer) means every linear map of *this* family's decoder layers (Phi-3's fused ``qkv_proj`` and
    ``gate_up_proj``, Qwen3-MoE's attention only: its experts are fused tensors, not linear modules)."""
    if list(requested) == list(LORA_TARGETS):
        return list(family_of(config).lora_targets)
    return list(requested)


def apply_lora(model: nn.Module, lora, seed: int = 0) -> nn.Module:
    """Inject adapters per ``lora`` (a ``LoraConfig`` section of the config) in place, initialise
    them by name from ``seed`` (``adapter_init``), freeze the rest. The global RNG is left as it
    was (peft's own draws happen on a forked RNG and are overwritten)."""
    if not lora.rank:
        return model
    from peft import LoraConfig, inject_adapter_in_model

    targets = default_targets(model.config, lora.target_modules)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        raise ValueError(f"train.lora.target_modules {missing} are not modules of this model; it has e.g. "
                         f"{sorted(x for x in present if x.endswith('proj'))}")
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=targets, bias="none")
    with torch.random.fork_rng(devices=[]):  # peft builds adapters on the CPU; CUDA's RNG is not touched
        model = inject_adapter_in_model(config, model)
    init_adapters(model, seed)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base layer and put the base layer back: a plain model."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], module.get_base_layer())
    for p in model.parameters():
        p.requires_grad_(True)
    return model
