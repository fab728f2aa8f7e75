"""Build one pipeline stage holding only its own weights, read from a safetensors folder.

Why: a distributed rank computes one stage. Loading the whole model and carving it
(``build_stages`` deep-copies it) costs every rank the whole model's memory, twice over while it
copies. Here the rank pays for its stage only:

1. the model's modules are built with their parameters on the meta device (no memory); buffers
   (the rotary ``inv_freq``) are real, computed from the config as a normal load computes them;
2. LoRA adapters are injected into that skeleton as into a loaded model (``apply_lora``);
3. the skeleton is carved by the same ``build_stages`` that carves a real model, so the stage's
   module names, structure, tied copies and ``requires_grad`` are those of the full path;
4. only the kept stage's parameters are materialized: base weights by their Hugging Face name from
   the safetensors file(s) (one file or a sharded folder with ``model.safetensors.index.json``),
   adapters by name from ``lora.adapter_init``. The other stages stay meta placeholders: boundaries
   attach to them as to real stages (registering their own modules), nothing computes on them.

Boundary builders that read the model (MAPL and SSN read the token embedding) get a
``ModelOnDisk``: the config, and the embedding read from the file only when asked for.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from thinpipe.config import ConfigError
from thinpipe.models.families import Layout, family_of
from thinpipe.models.lora import adapter_init, apply_lora
from thinpipe.models.stages import Stage, build_stages

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def has_safetensors(folder: Path) -> bool:
    """True when the folder's weights are safetensors (one file or sharded), which can be read by name."""
    return (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()


def tensor_files(folder: Path) -> dict[str, Path]:
    """Every tensor name of the folder's checkpoint -> the safetensors file that holds it."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise ConfigError(f"model folder {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def source_name(name: str, files: dict[str, Path], tied: bool, layout: Layout) -> str | None:
    """The checkpoint tensor a Hugging Face parameter name is read from: peft's ``base_layer``
    wrapper is not in the checkpoint, and a tied head is stored as the embedding (SmolLM2, Qwen2
    store no ``lm_head.weight``). None: the checkpoint lacks it."""
    name = name.replace(".base_layer.", ".")
    if name not in files and tied and name == layout.head_weight:
        name = layout.embedding_weight
    return name if name in files else None


def empty_model(config) -> PreTrainedModel:
    """The model's modules, in eval mode as ``load_model`` returns them, with parameters on the meta
    device and real buffers. ``init_empty_weights`` skips transformers' weight tying, so it is done
    here as ``from_pretrained`` does (the head then is the embedding, as in a loaded model)."""
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=family_of(config).attn_implementation(config))
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def materialize(stage: Stage, base_value, seed: int) -> None:
    """Give every meta parameter of ``stage`` its value: base weights from ``base_value(name, shape, dtype)``
    (their Hugging Face name; a checkpoint's tensor as fp32, like ``load_model``, or a scale preset's seeded
    draw), adapters from ``adapter_init``. A parameter shared by two modules (a one-stage tied model: embedding
    and head) stays one parameter."""
    meta: dict[int, tuple[nn.Parameter, str]] = {}
    for name, p in stage.named_parameters(remove_duplicate=False):
        if p.is_meta and id(p) not in meta:
            meta[id(p)] = (p, stage.hf_name(name))
    real: dict[int, nn.Parameter] = {}
    for key, (p, name) in meta.items():
        value = (adapter_init(name, p.shape, p.dtype, seed) if "lora_" in name else
                 base_value(name.replace(".base_layer.", "."), tuple(p.shape), p.dtype))
        real[key] = nn.Parameter(value, requires_grad=p.requires_grad)
    for module in stage.modules():
        for attr, p in module._parameters.items():
            if p is not None and id(p) in real:
                module._parameters[attr] = real[id(p)]
    left = [n for n, t in [*stage.named_parameters(), *stage.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"stage {stage.index}: tensors left on the meta device: {left[:5]}")


class FolderValues:
    """``materialize``'s base weights read from a Hugging Face folder's safetensors files (each opened once)."""

    def __init__(self, folder: Path, tied: bool, stack: ExitStack, stage: int, layout: Layout):
        self.folder, self.files, self.tied, self.stack = Path(folder), tensor_files(Path(folder)), tied, stack
        self.layout = layout
        self.stage = stage
        self.opened: dict[Path, object] = {}

    def __call__(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        source = source_name(name, self.files, self.tied, self.layout)
        if source is None:
            raise ConfigError(f"model folder {self.folder} has no tensor {name!r}, which stage {self.stage} needs")
        file = self.files[source]
        if file not in self.opened:
            self.opened[file] = self.stack.enter_context(safe_open(file, "pt"))
        value = self.opened[file].get_tensor(source)
        if tuple(value.shape) != shape:
            raise ConfigError(f"model folder {self.folder}: tensor {source!r} has shape {tuple(value.shape)}, "
                              f"the model's config gives {shape}")
        return value.to(dtype)


def stage_from_folder(folder: Path, index: int, split: list[int] | None, num_stages: int, lora,
                      seed: int) -> list[Stage]:
    """Every stage of the pipeline, of which only ``stages[index]`` holds weights (read from the
    folder; its adapters drawn as ``apply_lora`` draws them); the others are meta placeholders.
    Equal, tensor for tensor, to ``build_stages(apply_lora(load_model(folder)), ...)[index]``."""
    config = AutoConfig.from_pretrained(folder)
    skeleton = apply_lora(empty_model(config), lora, seed)
    stages = build_stages(skeleton, split, num_stages)  # a deep copy of meta tensors: no memory
    with ExitStack() as stack:
        materialize(stages[index], FolderValues(folder, bool(config.tie_word_embeddings), stack, index,
                                                family_of(config).layout), seed)
    return stages


class ModelOnDisk:
    """What boundary builders read from "the model" on a rank that holds one stage: its ``config``
    and ``get_input_embeddings()``, the token embedding read from the folder on first use (MAPL and
    SSN derive their fixed parts from it). Nothing else of the model is here."""

    def __init__(self, folder: Path):
        self.folder, self.config = Path(folder), AutoConfig.from_pretrained(folder)
        self._embedding: nn.Embedding | None = None

    def get_input_embeddings(self) -> nn.Embedding:
        if self._embedding is None:
            name = family_of(self.config).layout.embedding_weight
            files = tensor_files(self.folder)
            if name not in files:
                raise ConfigError(f"model folder {self.folder} has no tensor {name!r}, which the boundary needs")
            with safe_open(files[name], "pt") as f:
                weight = f.get_tensor(name).to(torch.float32)
            self._embedding = nn.Embedding.from_pretrained(weight, freeze=False,
                                                           padding_idx=getattr(self.config, "pad_token_id", None))
        return self._embedding
