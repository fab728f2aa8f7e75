"""How the fast circuit trains and is measured: ``[train]`` (with ``[train.lora]``), ``[eval]``, ``[diag]``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from thinpipe.config.errors import ConfigError
from thinpipe.config.post import OBJECTIVES
from thinpipe.plugins import PLUGIN_OBJECTIVES

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_STEPS = 10**7       # more is a typo (10**30 steps trained at lr ~1e-33 for ever: the warm-up alone is 3e28 steps)
MAX_SEQ_LEN = 2**20    # tokens per sequence: a longer one is a typo (10^9 would pack for hours before the first step)
FP32_TINY = 2.0**-126   # float32's smallest normal number: a smaller lr rounds to zero in the fp32 master weights


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank r (anchor-priors §6); 0 = full fine-tuning, > 0 trains only peft adapters."""
    alpha: float = 16.0
    """LoRA alpha: the adapter update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps runs bitwise repeatable)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Module names that get adapters (default: every linear map of the decoder layers, under the model
    family's own names: Phi-3's fused ``qkv_proj`` / ``gate_up_proj``; docs/models.md)."""
    save: str = "merged"
    """What the job's ``OUT/model/`` and ``thinpipe export`` write of a LoRA run: ``merged`` (the adapters folded
    into the base: a plain Hugging Face model) or ``adapter`` (peft's format, ``adapter_config.json`` and
    ``adapter_model.safetensors``, naming the base model's folder: ``PeftModel.from_pretrained(base, OUT/model)``)."""

    def validate(self) -> None:
        if self.save not in ("merged", "adapter"):
            raise ConfigError(f"train.lora.save must be merged or adapter, got {self.save!r}")
        if self.save == "adapter" and not self.rank:
            raise ConfigError("train.lora.save = adapter writes LoRA adapters, but train.lora.rank = 0 trains none: "
                              "set train.lora.rank > 0 or leave train.lora.save = merged")
        if self.rank < 0 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError(f"train.lora needs rank >= 0, alpha > 0 and 0 <= dropout < 1, got {self.rank}, "
                              f"{self.alpha}, {self.dropout}")
        if self.rank and not self.target_modules:
            raise ConfigError("train.lora.target_modules is empty: name the modules to adapt, e.g. [\"q_proj\"]")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 4
    """Sequences per step per fast replica (split into ``microbatches``)."""
    seq_len: int = 256
    """Tokens per packed sequence."""
    microbatches: int = 1
    """Microbatches per step; must divide batch_size."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``gpipe`` or ``1f1b`` (same numerics; they differ in memory and bubbles)."""
    lr: float = 2e-5
    """Peak learning rate (paper App. I.3: 2e-5)."""
    min_lr_ratio: float = 0.1
    """Cosine decays to this fraction of lr (App. I.3: 0.1)."""
    warmup_ratio: float = 0.03
    """Fraction of steps of linear warm-up (App. I.3: 3%)."""
    grad_clip: float = 0.2
    """Global gradient-norm clip (App. I.3: 0.2); 0 disables."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1 (App. I.3)."""
    beta2: float = 0.999
    """AdamW beta2 (App. I.3)."""
    seed: int = 0
    """Seed for initialisation, data order and the masking PRF."""
    dtype: str = "auto"
    """Compute precision: ``float32``, ``bfloat16`` (autocast; fp32 master weights, loss and optimizer) or
    ``auto``: bfloat16 on CUDA, float32 on the CPU (``thinpipe/placement.py`` says why)."""
    device: str = "auto"
    """Where stages compute: ``auto`` (CUDA when available), ``cpu``, ``cuda`` (a dist rank takes
    ``cuda:(LOCAL_RANK mod GPUs)``, the simulation ``cuda:0``) or ``cuda:N``."""
    deterministic: bool = False
    """CUDA only: refuse kernels without a deterministic implementation (slower; CPU runs are always
    deterministic)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input in the forward and recompute its activations in the backward (per
    layer of every stage; anchor-priors App. I: "gradient checkpointing enabled"): less memory for one more forward;
    the same loss and gradients."""
    loss_chunk_tokens: int = 4096
    """The last stage computes the head and the next-token loss over at most this many tokens at a time, recomputed
    in the backward, so the (tokens x vocabulary) logits and their gradient never exist whole (0 = all at once;
    objectives that read the logits, DPO and GSPO, take them whole)."""
    cpu_heap_trim: bool = True
    """On the CPU, return the heap's free pages to the system after each decoder layer's forward and backward (glibc's
    ``malloc_trim``; ``models/heap.py``; layers whose input is under 1 MiB skip it): a layer's freed temporaries
    otherwise stay resident, about doubling a CPU rank's activation memory (llama-150m, 2 x 2,048 tokens: 5.56 -> 3.47
    GiB peak RSS). No effect on the numbers, on a GPU, or off glibc."""
    checkpoint_every: int = 50
    """Write a resumable checkpoint (atomically) every N steps and at the end (0 = only at the end)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept (newest first): a damaged newest one falls back to the one before."""
    on_divergence: str = "stop"
    """What a non-finite loss, gradient norm or weights does: ``stop`` (one line naming the last good
    checkpoint, exit code 3) or ``rollback``: reload the last good checkpoint, multiply ``train.lr``
    by ``rollback_lr_factor`` and go on (at most ``max_rollbacks`` times; then stop)."""
    rollback_lr_factor: float = 0.5
    """``on_divergence = rollback``: the factor applied to ``train.lr`` at each rollback."""
    max_rollbacks: int = 3
    """``on_divergence = rollback``: rollbacks allowed in one run before it stops."""
    optimizer: str = "adamw"
    """``adamw`` for every parameter, or ``muon``: Muon (Polar Express) for the decoder layers' 2-D
    weights at train.lr and AdamW for the rest at optim.muon.adam_lr_scale x train.lr (MAPL App. E.3)."""
    objective: str = "sft"
    """What the step optimises: ``sft`` (next-token loss), ``dpo`` (preference pairs, section ``[dpo]``) or
    ``gspo`` (RL with verifiable rewards on rollouts sampled on the mesh, section ``[rl]``): anchor-priors App. D."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters via peft (train.lora.rank > 0 turns them on)."""
    model_rank: int = 0
    """The global rank that receives the job's model at its end and writes ``OUT/model/`` into its own
    ``--out`` (a fast rank: 0 .. mesh.dp x mesh.pp - 1): across machines, the machine the model should end on.
    The simulation and elastic launchers write it in their one folder."""

    def validate(self) -> None:
        self.lora.validate()
        if self.model_rank < 0:
            raise ConfigError(f"train.model_rank must be a global rank >= 0, got {self.model_rank}")
        for name in ("steps", "batch_size", "seq_len", "microbatches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.steps > MAX_STEPS:
            raise ConfigError(f"train.steps = {self.steps} is more than 10^7 steps: give the number of optimizer steps "
                              "to train (e.g. 1000)")
        if self.seq_len > MAX_SEQ_LEN:
            raise ConfigError(f"train.seq_len = {self.seq_len} is more than 2^20 tokens per sequence: give the packed "
                              "sequence length (e.g. 2048)")
        if self.batch_size % self.microbatches:
            raise ConfigError(
                f"train.microbatches = {self.microbatches} does not divide train.batch_size = {self.batch_size}")
        if self.schedule not in ("gpipe", "1f1b"):
            raise ConfigError(f"train.schedule must be gpipe or 1f1b, got {self.schedule!r}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if self.lr < FP32_TINY:  # the schedule's peak: every step's lr is at most this, so every update is lost
            raise ConfigError(f"train.lr = {self.lr:g} rounds to zero in float32 (below {FP32_TINY:.3g}): give a "
                              "learning rate such as 2e-5")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip must be >= 0 (0 disables), got {self.grad_clip}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"train.dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"train.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.loss_chunk_tokens < 0:
            raise ConfigError(f"train.loss_chunk_tokens must be >= 0 (0 = the whole microbatch at once), got "
                              f"{self.loss_chunk_tokens}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"train.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"train.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.on_divergence not in ("stop", "rollback"):
            raise ConfigError(f"train.on_divergence must be stop or rollback, got {self.on_divergence!r}")
        if not 0 < self.rollback_lr_factor < 1 or self.max_rollbacks < 0:
            raise ConfigError(f"train.rollback_lr_factor must be in (0, 1) and train.max_rollbacks >= 0, got "
                              f"{self.rollback_lr_factor} and {self.max_rollbacks}")
        if self.objective not in OBJECTIVES and self.objective not in PLUGIN_OBJECTIVES:  # a plugin's: plugins.py
            raise ConfigError(f"train.objective must be one of {', '.join([*OBJECTIVES, *PLUGIN_OBJECTIVES])}, got "
                              f"{self.objective!r}")
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"train.optimizer must be adamw or muon, got {self.optimizer!r}")


@dataclass(kw_only=True, slots=True)
class DiagConfig:
    every: int = 0
    """Every N steps, also compute the clean (unmasked) gradient at the same weights and batch and
    log its cosine with the masked and the corrected gradient (costs one extra pass; 0 = off)."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"diag.every must be >= 0, got {self.every}")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every: int = 0
    """Validation loss every N steps (0 = only at the start and the end)."""
    tasks: list[str] = field(default_factory=list)
    """Multiple-choice tasks scored through the mesh each time the held-out measure is (every ``eval.every`` steps
    and at the end), e.g. ``["arc_easy"]``: columns ``val_acc_<task>`` / ``val_acc_norm_<task>`` in those
    ``metrics.jsonl`` rows, ``final_val_acc_<task>`` in ``summary.json`` (``objective/task_scores.py``)."""
    limit: int = 100
    """Items per task in ``tasks`` (its first ones, in the split's order)."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.every must be >= 0, got {self.every}")
        if self.limit < 1:
            raise ConfigError(f"eval.limit must be >= 1, got {self.limit}")
