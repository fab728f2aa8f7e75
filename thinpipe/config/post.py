"""After SFT (anchor-priors §5.6, App. D: SFT -> DPO -> GSPO): the ``[dpo]`` and ``[rl]`` sections and the
checks that tie ``train.objective`` to the rest of a config."""

from __future__ import annotations

from dataclasses import dataclass

from thinpipe.config.errors import ConfigError

OBJECTIVES = ("sft", "dpo", "gspo")
# Each objective's own optimizer settings, taken unless the user's --config / --set gives the key (load_config).
# SFT's are the [train] defaults (anchor-priors App. I.3). GSPO: anchor-priors App. D.5 (AdamW 1e-6, weight
# decay 0.1, clip 1.0, warm-up 5%). DPO: the paper gives none; TRL's DPOConfig (learning_rate 1e-6 over
# transformers' TrainingArguments: weight_decay 0, max_grad_norm 1.0, no warm-up), the trainer the peer tests
# check thinpipe's DPO loss against (tests/integration/test_trl_peer.py).
OBJECTIVE_DEFAULTS: dict[str, dict[str, float]] = {
    "gspo": {"train.lr": 1e-6, "train.weight_decay": 0.1, "train.grad_clip": 1.0, "train.warmup_ratio": 0.05},
    "dpo": {"train.lr": 1e-6, "train.weight_decay": 0.0, "train.grad_clip": 1.0, "train.warmup_ratio": 0.0},
}


@dataclass(kw_only=True, slots=True)
class DPOConfig:
    beta: float = 0.1
    """DPO's beta (Rafailov et al. 2023; TRL's default 0.1): the strength of the implicit KL to the reference."""

    def validate(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"dpo.beta must be > 0, got {self.beta} (TRL's default: 0.1)")


@dataclass(kw_only=True, slots=True)
class RLConfig:
    group_size: int = 4
    """Rollouts sampled per prompt (GRPO's group G): advantages are rewards standardised within a group."""
    prompts_per_step: int = 4
    """Prompts per step per fast replica; a step's batch is prompts_per_step x group_size sequences."""
    minibatches: int = 1
    """Optimizer updates per step, each on 1/minibatches of the step's sequences; more than one makes the
    later updates off-policy, so that the clipping acts."""
    clip_low: float = 3e-4
    """Lower clip range of the importance ratio: 1 - clip_low (GSPO's 3e-4; anchor-priors App. D)."""
    clip_high: float = 4e-4
    """Upper clip range of the importance ratio: 1 + clip_high (GSPO's 4e-4)."""
    ratio_level: str = "sequence"
    """``sequence``: GSPO's ratio exp(mean token log-ratio) per sequence; ``token``: GRPO's per-token ratio."""
    max_response_tokens: int = 128
    """New tokens sampled per rollout at most (prompt + response must fit train.seq_len: with its default 256,
    prompts of up to 128 tokens)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: responses longer than max_response_tokens - overlong_buffer are
    penalised linearly up to overlong_penalty (0 = off; the paper's recipe 7,680 / 3,584 / 1.0)."""
    overlong_penalty: float = 1.0
    """The overlong punishment at max_response_tokens (a reward of 1 is a correct answer)."""
    rollout_boundaries: str = "dense"
    """What rollouts are sampled through: ``dense`` boundaries (old log-probs are recomputed by the training
    forward, as VeRL does) or the ``train``ing ones."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling of the rollouts (1 = off)."""
    top_k: int = 0
    """Top-k sampling of the rollouts (0 = off)."""
    kl_beta: float = 0.0
    """Weight of a KL penalty to the starting weights (k3 estimator, as TRL's beta); 0 = none (GSPO's default)."""
    scale_rewards: bool = True
    """Divide a group's centred rewards by their standard deviation (GRPO); false: centre only (Dr. GRPO)."""

    def validate(self) -> None:
        for name in ("group_size", "prompts_per_step", "minibatches", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ConfigError(f"rl.group_size = {self.group_size}: a group needs at least 2 rollouts to have an "
                              "advantage (GRPO standardises rewards within a group): use 2 or more")
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ConfigError(f"rl.clip_low must be in (0, 1) and rl.clip_high > 0, got {self.clip_low} and "
                              f"{self.clip_high} (GSPO: 3e-4 and 4e-4)")
        if self.ratio_level not in ("sequence", "token"):
            raise ConfigError(f"rl.ratio_level must be sequence or token, got {self.ratio_level!r}")
        if not 0 <= self.overlong_buffer < self.max_response_tokens:
            raise ConfigError(f"rl.overlong_buffer must be in [0, rl.max_response_tokens = {self.max_response_tokens}),"
                              f" got {self.overlong_buffer}")
        if self.overlong_penalty < 0:
            raise ConfigError(f"rl.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        if self.rollout_boundaries not in ("dense", "train"):
            raise ConfigError(f"rl.rollout_boundaries must be dense or train, got {self.rollout_boundaries!r}")
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"rl.temperature must be > 0, rl.top_p in (0, 1] and rl.top_k >= 0, got "
                              f"{self.temperature}, {self.top_p}, {self.top_k}")
        if self.kl_beta < 0:
            raise ConfigError(f"rl.kl_beta must be >= 0 (0 = no KL), got {self.kl_beta}")

    @property
    def sequences(self) -> int:
        """Sequences of a step per fast replica."""
        return self.prompts_per_step * self.group_size


def check_objective(cfg) -> None:
    """What ``train.objective`` needs of the rest of the config (one line each)."""
    t, rl, obj = cfg.train, cfg.rl, cfg.train.objective
    if obj == "sft":
        return
    if t.lora.rank and t.lora.dropout:
        # every forward would draw new dropout masks: a sequence's old-log-prob, reference and update forwards
        # would differ (TRL's trainers disable dropout for the same reason)
        raise ConfigError(f"train.lora.dropout = {t.lora.dropout} makes two forwards of one sequence differ, which "
                          f"train.objective = {obj} compares: set train.lora.dropout = 0")
    if obj == "gspo":
        if t.microbatches != 1:
            raise ConfigError(f"train.microbatches = {t.microbatches} does not apply to gspo: train.batch_size "
                              "sequences go through each forward; set train.microbatches = 1")
        if rl.sequences % rl.minibatches:
            raise ConfigError(f"rl.minibatches = {rl.minibatches} does not divide a step's {rl.sequences} sequences "
                              f"(rl.prompts_per_step x rl.group_size)")
        per_update = rl.sequences // rl.minibatches
        if per_update % t.batch_size:
            raise ConfigError(f"train.batch_size = {t.batch_size} (sequences per forward) does not divide the "
                              f"{per_update} sequences of an update (rl.prompts_per_step x rl.group_size / "
                              "rl.minibatches)")
        if rl.kl_beta > 0 and cfg.boundary.spec().architectural:
            raise ConfigError(f"rl.kl_beta > 0 keeps a dense copy of the starting weights, but boundary.kind = "
                              f"{cfg.boundary.kind} is part of the model: set rl.kl_beta = 0 (GSPO's recipe has no KL)")
        if rl.max_response_tokens >= t.seq_len:
            raise ConfigError(f"rl.max_response_tokens = {rl.max_response_tokens} leaves no room for the prompt in "
                              f"train.seq_len = {t.seq_len}: raise train.seq_len or lower rl.max_response_tokens")
