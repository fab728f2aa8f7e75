"""Random init, one parameter at a time: what lets a rank build its own stage alone (issue: past 135M).

A scale preset (``models/presets.py: SCALES``) is too large for every rank to build the whole model and carve it.
Each parameter is drawn from a generator of its own, seeded by (run seed, its Hugging Face name), with the
distribution transformers' Llama init uses (``LlamaPreTrainedModel._init_weights``: normal(0, initializer_range)
for linear and embedding weights, ones for RMSNorm weights, zeros for biases). So a parameter's value does not
depend on which process draws it, in which order, or how the model is split: a 1-stage job equals the same
model split in 4, and the simulation equals the real mesh, bitwise.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from transformers import PreTrainedModel

from thinpipe.models.lora import apply_lora
from thinpipe.models.stage_loading import empty_model, materialize
from thinpipe.models.stages import Stage, build_stages


def parameter_seed(seed: int, name: str) -> int:
    """A stable hash of (run seed, Hugging Face parameter name), the same in every process and Python session."""
    digest = hashlib.sha256(f"thinpipe-init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(name: str, shape, dtype: torch.dtype, seed: int, std: float) -> torch.Tensor:
    """The initial value of base parameter ``name`` (e.g. ``model.layers.3.mlp.up_proj.weight``)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g).to(dtype)


class ScaleValues:
    """``stage_loading.materialize``'s base weights of a scale preset: each parameter's own seeded draw."""

    def __init__(self, seed: int, std: float):
        self.seed, self.std = seed, std

    def __call__(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return initial_value(name, shape, dtype, self.seed, self.std)


@torch.no_grad()
def scale_model(config, seed: int) -> PreTrainedModel:
    """The whole model of ``config`` with every parameter drawn by ``initial_value`` (what one process that holds
    every stage builds: the simulation, a 1-stage job)."""
    model = empty_model(config)
    values = ScaleValues(seed, config.initializer_range)
    for prefix, module in model.named_modules():
        for attr, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                name = f"{prefix}.{attr}" if prefix else attr
                module._parameters[attr] = nn.Parameter(values(name, tuple(p.shape), p.dtype),
                                                        requires_grad=p.requires_grad)
    return model


def scale_stages(config, index: int, split: list[int] | None, num_stages: int, lora, seed: int) -> list[Stage]:
    """Every stage of ``config``'s pipeline, of which only ``stages[index]`` holds weights, drawn as
    ``scale_model`` draws them (its adapters as ``apply_lora`` draws them); the others are meta placeholders.
    Equal, tensor for tensor, to ``build_stages(apply_lora(scale_model(config, seed)), ...)[index]``."""
    skeleton = apply_lora(empty_model(config), lora, seed)
    stages = build_stages(skeleton, split, num_stages)  # a deep copy of meta tensors: no memory
    materialize(stages[index], ScaleValues(seed, config.initializer_range), seed)
    return stages


class ScaleModelOnDisk:
    """What boundary builders read from "the model" on a rank that holds one stage of a scale preset (as
    ``stage_loading.ModelOnDisk`` for a folder): its ``config`` and its token embedding, drawn on first use."""

    def __init__(self, config, seed: int):
        self.config, self.seed = config, seed
        self._embed: nn.Embedding | None = None

    def get_input_embeddings(self) -> nn.Embedding:
        if self._embed is None:
            c = self.config
            weight = initial_value("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), torch.float32,
                                   self.seed, c.initializer_range)
            self._embed = nn.Embedding.from_pretrained(weight, freeze=False,
                                                       padding_idx=getattr(c, "pad_token_id", None))
        return self._embed
