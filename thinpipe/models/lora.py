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
"""

from __future__ import annotations

from torch import nn


def apply_lora(model: nn.Module, lora) -> nn.Module:
    """Inject adapters per ``lora`` (a ``LoraConfig`` section of the config) in place; freeze the rest."""
    if not lora.rank:
        return model
    from peft import LoraConfig, inject_adapter_in_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in lora.target_modules if t not in present]
    if missing:
        raise ValueError(f"train.lora.target_modules {missing} are not modules of this model; it has e.g. "
                         f"{sorted(x for x in present if x.endswith('proj'))}")
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), bias="none")
    model = inject_adapter_in_model(config, model)
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
