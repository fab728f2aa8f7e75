"""What both engines derive from a config in the same way: dtypes, the lr schedule, data streams (an objective's
rows are its own: ``objective/spec.py: ObjectiveSpec.data``).

Each function is the one definition the simulation and the distributed engine share, so that the
two runs of one config see the same model, data, batches and learning rates (one code path: docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from transformers import AutoConfig, GenerationConfig

from thinpipe.config import Config, ConfigError
from thinpipe.data import PackedDataset, batches
from thinpipe.models import LoadedModel, Stage, build_stages, load_model
from thinpipe.models.loading import load_tokenizer, model_folder, scale_setup
from thinpipe.models.lora import apply_lora
from thinpipe.models.presets import SCALES
from thinpipe.models.scale_init import ScaleModelOnDisk, scale_stages
from thinpipe.models.stage_loading import ModelOnDisk, empty_model, has_safetensors, stage_from_folder
from thinpipe.optim import cosine_with_warmup
from thinpipe.placement import DTYPES, compute_dtype_name, resolve_device, use_deterministic

PCA_SEED_OFFSET = 1_000_003  # the residual start's own data stream: the training order stays a random start's


def place(cfg: Config, local_rank: int | None = None) -> torch.device:
    """This process's device (``train.device``); resolves ``train.dtype = auto`` on it in ``cfg``, so
    that the run folder's config records the precision the run used (a resume keeps it)."""
    device = resolve_device(cfg.train.device, local_rank)
    cfg.train.dtype = compute_dtype_name(cfg.train.dtype, device)
    use_deterministic(cfg.train.deterministic, device)
    return device


def wire_dtype(cfg: Config, device: torch.device = torch.device("cpu")) -> torch.dtype | None:
    """The dtype activations and their gradients travel in (None: as computed, i.e. fp32); with
    ``boundary.dtype = auto`` the compute dtype on ``device``."""
    name = compute_dtype_name(cfg.train.dtype, device) if cfg.boundary.dtype == "auto" else cfg.boundary.dtype
    return None if name == "float32" else DTYPES[name]


def lr_at(cfg: Config, step: int) -> float:
    t = cfg.train
    return t.lr * cosine_with_warmup(step, t.steps, t.warmup_ratio, t.min_lr_ratio)


def load(cfg: Config) -> LoadedModel:
    """The configured model (seeded), with LoRA adapters when configured; checks the mesh fits it."""
    torch.manual_seed(cfg.train.seed)
    loaded = load_model(cfg.model.name, seed=cfg.train.seed, tokenizer=cfg.model.tokenizer)
    apply_lora(loaded.model, cfg.train.lora, cfg.train.seed)
    check_layers(cfg, loaded.model.config.num_hidden_layers)
    return loaded


def load_empty(cfg: Config) -> LoadedModel:
    """The configured model as ``load`` builds it (LoRA included) with every parameter on the meta device (no
    memory; buffers real), for a whole model's weights to be assigned into (``engine/job_model.py``: the writer of
    the job's model then holds its weights once, not a drawn or read copy beside them). From a safetensors folder
    (its generation config too) and the scale presets; the random presets, a few MB, are loaded as ``load`` does."""
    folder = model_folder(cfg.model.name)
    if cfg.model.name in SCALES:
        tokenizer, config = scale_setup(cfg.model.name, cfg.model.tokenizer)
    elif folder is not None and has_safetensors(folder):
        tokenizer, config = load_tokenizer(folder), AutoConfig.from_pretrained(folder)
    else:
        return load(cfg)
    model = empty_model(config)
    if folder is not None and (folder / "generation_config.json").is_file():  # what from_pretrained reads too
        model.generation_config = GenerationConfig.from_pretrained(folder)
    apply_lora(model, cfg.train.lora, cfg.train.seed)  # in place: the model keeps its class
    return LoadedModel(model, tokenizer, cfg.model.name)


def check_layers(cfg: Config, n_layers: int) -> None:
    if cfg.mesh.pp > n_layers:
        raise ConfigError(f"mesh.pp = {cfg.mesh.pp} stages but {cfg.model.name} has only {n_layers} layers")


class BoundaryModel(Protocol):
    """What boundary builders read of "the model": the whole model, or a rank's ``ModelOnDisk`` /
    ``ScaleModelOnDisk``."""

    config: Any  # the model's (Hugging Face) config

    def get_input_embeddings(self) -> nn.Module: ...


@dataclass
class LoadedStage:
    """What one rank of a distributed run starts from. ``stages`` is every stage of the pipeline, of
    which only ``stages[index]`` is the rank's own; ``model`` is what boundary builders read (the
    whole model, or a ``ModelOnDisk``: its config, and its token embedding read on demand)."""

    stages: list[Stage]
    tokenizer: object
    model: BoundaryModel
    hidden_size: int


def configure_stage(stage, cfg: Config):
    """``stage`` computing as the run's config says (``models/stages.py: Stage``): packed-document attention
    (``model.attention``), activation checkpointing, the chunked loss, the CPU heap's trim. Every place that builds a
    run's stages calls it (this module's ``load_stage``, ``SimMesh``, the simulated anchor circuit)."""
    stage.packed_attention = cfg.model.attention == "packed"
    stage.checkpoint_layers = cfg.train.activation_checkpointing
    stage.loss_chunk_tokens = cfg.train.loss_chunk_tokens
    stage.trim_heap = cfg.train.cpu_heap_trim
    return stage


def load_stage(cfg: Config, index: int, whole: bool = False) -> LoadedStage:
    """Stage ``index`` configured (``configure_stage``) as ``_load_stage`` reads it."""
    loaded = _load_stage(cfg, index, whole)
    for st in loaded.stages:
        configure_stage(st, cfg)
    return loaded


def _load_stage(cfg: Config, index: int, whole: bool = False) -> LoadedStage:
    """Stage ``index`` of the configured model (seeded, with LoRA when configured), equal tensor for
    tensor to ``build_stages(load(cfg).model, ...)[index]``, holding only its own weights: from a
    safetensors folder (a Hugging Face folder; SmolLM2 and a .gguf after their one-time conversion)
    the other stages are meta placeholders and only this stage's tensors are read
    (``models/stage_loading.py``). The random presets (``tiny-*``, ``small-llama``) are tiny and
    built from a seed, not read from files: they, a folder without safetensors weights, and
    ``whole=True`` (the benchmark's "before": ``benchmarks/stage_memory.py``) load the whole model
    and carve it. The global RNG is left as ``load`` leaves it."""
    m = cfg.mesh
    if not whole and cfg.model.name in SCALES:  # this stage's parameters alone, each its own seeded draw
        torch.manual_seed(cfg.train.seed)
        tokenizer, config = scale_setup(cfg.model.name, cfg.model.tokenizer)
        check_layers(cfg, config.num_hidden_layers)
        stages = scale_stages(config, index, m.fixed_split, m.pp, cfg.train.lora, cfg.train.seed)
        return LoadedStage(stages, tokenizer, ScaleModelOnDisk(config, cfg.train.seed), config.hidden_size)
    folder = model_folder(cfg.model.name)
    if whole or folder is None or not has_safetensors(folder):
        loaded = load(cfg)
        return LoadedStage(build_stages(loaded.model, m.fixed_split, m.pp), loaded.tokenizer, loaded.model,
                           loaded.model.config.hidden_size)
    torch.manual_seed(cfg.train.seed)
    disk = ModelOnDisk(folder)
    check_layers(cfg, disk.config.num_hidden_layers)
    stages = stage_from_folder(folder, index, m.fixed_split, m.pp, cfg.train.lora, cfg.train.seed)
    return LoadedStage(stages, load_tokenizer(folder), disk, disk.config.hidden_size)


def val_batches(val: PackedDataset, batch_size: int):
    for i in range(0, len(val), batch_size):
        yield val.rows(slice(i, i + batch_size))


def replica_stream(cfg: Config, train: PackedDataset, replica: int, start_step: int):
    """Fast replica ``replica``'s batches from step ``start_step`` on (the anchor has its own shard)."""
    t = cfg.train
    return batches(train, t.batch_size, t.seed, shard=replica, num_shards=cfg.mesh.dp + cfg.mesh.anchor,
                   start_step=start_step)


def anchor_stream(cfg: Config, train: PackedDataset, start_step: int):
    """The anchor replica's batches, one per cycle, from the first cycle at or after ``start_step``."""
    every = cfg.anchor.every or cfg.anchor.staleness
    return anchor_batches(cfg, train, -(-start_step // every))  # cycles started at 0, every, 2 every, ... < start


def anchor_batches(cfg: Config, train: PackedDataset, cycles_done: int):
    """The anchor replica's batches after ``cycles_done`` cycles (with ``arrival`` delivery a real
    anchor skips cycles, so its position is counted in cycles run, not in steps)."""
    t = cfg.train
    return batches(train, t.batch_size, t.seed, shard=cfg.mesh.dp, num_shards=cfg.mesh.dp + cfg.mesh.anchor,
                   start_step=cycles_done)


def residual_batches(cfg: Config, train: PackedDataset) -> list[dict]:
    """The batches a residual start (MAPL's PCA start) computes on."""
    stream = batches(train, cfg.train.batch_size, cfg.train.seed + PCA_SEED_OFFSET)
    return [next(stream) for _ in range(cfg.boundary.pca_batches)]
