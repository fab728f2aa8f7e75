"""The post-SFT objectives of the anchor-priors paper (§5.6, App. D.2-D.4: SFT -> DPO -> GSPO with a verifiable
reward), as plain functions on tensors.

- ``response_logprobs`` / ``token_entropy``: per-position log p(next token) and entropy under the causal shift.
- ``group_advantages``: GRPO's group-relative advantage (Shao et al. 2024, DeepSeekMath §4.1.2), the estimator of
  App. D.4 (adv_estimator = "grpo"), with TRL ``GRPOTrainer``'s unbiased std and 1e-4 guard.
- ``policy_loss``: the clipped surrogate at sequence level (GSPO, Zheng et al. 2025, arXiv 2507.18071 §4.1) or
  token level (GRPO), aggregated "seq-mean-token-mean" (App. D.4), with an optional k3 KL to a reference.
- ``dpo_loss``: the sigmoid DPO loss (Rafailov et al. 2023, arXiv 2305.18290 eq. (7)).

Every function takes its tensors and settings explicitly; nothing here knows about models or the pipeline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from thinpipe.config import ConfigError

IGNORE_INDEX = -100
ADV_EPS = 1e-4  # TRL GRPOTrainer: advantages / (std + 1e-4)
LEVELS = ("sequence", "token")


def _picked_dtype(logits: torch.Tensor) -> torch.Tensor:
    # The GSPO clip window is 3e-4 wide (App. D.4): a bf16 log-softmax (about 3 significant digits) would put
    # the ratio's rounding error above the window, so low-precision logits are read in float32.
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def _check_shift(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"logits (B, T, V) and labels (B, T) expected, got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")


def response_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log-probability of the next label: ``logp[:, j] = log softmax(logits[:, j])[labels[:, j+1]]``.

    Returns ``(logp, mask)``, both (B, T-1): ``mask = labels[:, 1:] != -100`` and ``logp`` is exactly 0 where the
    mask is False (so sums over positions need no mask and padding never carries a gradient). ``logp`` is float32
    (float64 for float64 logits).

    Memory: ``gather`` minus ``logsumexp`` on the unsliced (B, T, V) logits, then the (B, T) results are sliced;
    slicing the logits to ``[:, :-1]`` first would copy them and, backward, fill a zero (B, T, V) gradient
    (the same reasoning as ``thinpipe.models.stages.next_token_loss``). No (B, T, V) log-softmax is kept.
    """
    _check_shift(logits, labels)
    work = _picked_dtype(logits)
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    nxt = F.pad(targets.clamp(min=0), (0, 1), value=0)  # (B, T): position j holds labels[:, j+1]
    picked = work.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
    logp = (picked - torch.logsumexp(work, dim=-1))[:, :-1]
    return torch.where(mask, logp, torch.zeros((), dtype=logp.dtype, device=logp.device)), mask


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) sum over each row's completion tokens of log p(token | prefix)."""
    logp, _ = response_logprobs(logits, labels)
    return logp.sum(-1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits[:, j])`` at each position ``j`` whose next label is not -100, else 0: (B, T-1).

    A diagnostic (entropy collapse during RL, App. D.1), so it carries no gradient; one batch row at a time,
    so the float32 temporary is (T, V), not (B, T, V).
    """
    _check_shift(logits, labels)
    mask = labels[:, 1:] != IGNORE_INDEX
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = torch.zeros(mask.shape, dtype=dtype, device=logits.device)
    for b in range(logits.shape[0]):
        logp = torch.log_softmax(logits[b, :-1].to(dtype), dim=-1)
        out[b] = -(logp.exp() * logp).sum(-1)
    return out.masked_fill_(~mask, 0.0)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """GRPO's group-relative advantage: rewards come in consecutive groups of ``group_size`` completions of one
    prompt; ``A = r - mean_group`` and, when ``scale``, ``A / (std_group + 1e-4)`` with the unbiased std
    (``torch.std``), as TRL's ``GRPOTrainer`` (scale_rewards="group" / "none"). A group whose rewards are all
    equal carries no signal and gets exactly 0 (its mean can differ from its members by rounding)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ConfigError(f"group size {group_size} does not divide the {rewards.numel()} rewards: set the number "
                          "of completions per prompt to a divisor of the rollout batch")
    r = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32).view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        # A group of one has no spread (torch.std would be NaN); it is zeroed below anyway.
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(adv)
        adv = adv / (std + ADV_EPS)
    flat = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(adv), adv).reshape(-1)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                clip_low: float, clip_high: float, level: str = "sequence", ref_logp: torch.Tensor | None = None,
                kl_beta: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss per sequence, (B,), token-mean within each sequence ("seq-mean-token-mean",
    App. D.4); the caller sums these times 1 / (sequences in the whole mini-batch).

    Per masked token t of sequence i: ``-min(c_t * A_i, clamp(c_t, 1 - clip_low, 1 + clip_high) * A_i)``
    (+ ``kl_beta * kl_t`` when ``kl_beta > 0``), where

    - level "sequence" (GSPO, arXiv 2507.18071 §4.1): ``s_i = exp(mean_t (logp - old_logp))``, written per token
      as ``c_t = exp(logp_t - sg(logp_t) + sg(log s_i))`` (the paper's GSPO-token form, §4.3, which equals GSPO
      when every token carries A_i): its value is ``s_i`` and its token-mean gradient is ``s_i * A_i / |y_i|``
      per token, the gradient of ``s_i * A_i`` itself (§4.2); TRL ``GRPOTrainer``'s
      importance_sampling_level="sequence" computes the same value and gradient on a (B, 1) ratio;
    - level "token" (GRPO): ``c_t = exp(logp_t - old_logp_t)``.

    The KL is TRL's k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (Schulman's "approximating KL", as in
    DeepSeekMath eq. (4)), per token, without importance correction. App. D.4 runs with no KL (kl_beta = 0).

    Returns ``(loss (B,), stats)``; ``stats`` are 0-d detached tensors on ``logp``'s device (no host sync, so the
    caller sums them across micro-batches and replicas and reads them once): ``tokens`` (masked tokens),
    ``clipped`` / ``low_clipped`` / ``high_clipped`` (masked tokens where the clip is active: ``c < 1 - clip_low``
    with ``A < 0``, ``c > 1 + clip_high`` with ``A > 0``, TRL's is_low_clipped / is_high_clipped; at sequence level
    every token of a clipped sequence counts), ``kl`` (sum of per-token KL over masked tokens, 0 without KL) and
    ``log_ratio_abs_max`` (max |logp - old_logp| over masked tokens, 0 if none: aggregate it with max, not sum).
    A sequence with no masked token has loss 0 and no gradient.
    """
    if level not in LEVELS:
        raise ConfigError(f"importance-sampling level {level!r} is not one of {', '.join(LEVELS)}: set it to "
                          "'sequence' (GSPO) or 'token' (GRPO)")
    if clip_low < 0 or clip_high < 0:
        raise ConfigError(f"clip ratios must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if kl_beta < 0:
        raise ConfigError(f"kl_beta must be >= 0, got {kl_beta}")
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"logp, old_logp and mask must share one (B, L) shape, got {tuple(logp.shape)}, "
                         f"{tuple(old_logp.shape)}, {tuple(mask.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be (B,) = ({logp.shape[0]},), got {tuple(advantages.shape)}")
    use_kl = kl_beta > 0
    if use_kl and (ref_logp is None or ref_logp.shape != logp.shape):
        raise ValueError("kl_beta > 0 needs ref_logp of the same (B, L) shape as logp")

    mask = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Padding may hold anything (-inf from a masked log-softmax, stale values): zero it before any exp, so that
    # neither the forward nor the backward (where() passes 0 * inf = NaN through exp) sees it.
    lp = torch.where(mask, logp, zero)
    old = torch.where(mask, old_logp.to(logp.dtype), zero)
    m = mask.to(logp.dtype)
    count = m.sum(-1)
    denom = count.clamp(min=1.0)
    log_ratio = lp - old
    if level == "token":
        log_w = log_ratio
    else:
        seq = log_ratio.sum(-1) / denom
        log_w = lp - lp.detach() + seq.detach().unsqueeze(-1)
    coef = torch.exp(log_w)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    clipped_coef = torch.clamp(coef, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.min(coef * adv, clipped_coef * adv)
    if use_kl:
        assert ref_logp is not None  # use_kl: checked above
        ref = torch.where(mask, ref_logp.to(logp.dtype), zero)
        kl = torch.exp(ref - lp) - (ref - lp) - 1.0
        per_token = per_token + kl_beta * kl
    loss = torch.where(mask, per_token, zero).sum(-1) / denom

    with torch.no_grad():
        c = coef.detach()
        low = (c < 1.0 - clip_low) & (adv < 0) & mask
        high = (c > 1.0 + clip_high) & (adv > 0) & mask
        abs_ratio = torch.where(mask, log_ratio.detach().abs(), zero)
        stats = {
            "tokens": count.sum(),
            "clipped": (low | high).sum().to(logp.dtype),
            "low_clipped": low.sum().to(logp.dtype),
            "high_clipped": high.sum().to(logp.dtype),
            "log_ratio_abs_max": abs_ratio.max() if abs_ratio.numel() else zero.clone(),
            "kl": torch.where(mask, kl.detach(), zero).sum() if use_kl else zero.clone(),
        }
    return loss, stats


def dpo_loss(chosen_logp: torch.Tensor, rejected_logp: torch.Tensor, ref_chosen_logp: torch.Tensor,
             ref_rejected_logp: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss (arXiv 2305.18290 eq. (7)) per pair: ``-logsigmoid(beta * ((c - rc) - (r - rr)))`` on
    summed response log-probs, with the implicit rewards ``beta * (logp - ref)`` (detached), as TRL's
    ``DPOTrainer`` (loss_type "sigmoid", label_smoothing 0). Returns ``(losses, chosen_rewards, rejected_rewards)``,
    each (B,); the batch loss is ``losses.mean()``."""
    if beta <= 0:
        raise ConfigError(f"DPO beta must be > 0, got {beta}: set the DPO beta (e.g. 0.1)")
    shape = chosen_logp.shape
    if any(t.shape != shape for t in (rejected_logp, ref_chosen_logp, ref_rejected_logp)) or chosen_logp.dim() != 1:
        raise ValueError("chosen, rejected and both reference log-probs must be (B,) tensors of one shape")
    chosen_ratio = chosen_logp - ref_chosen_logp
    rejected_ratio = rejected_logp - ref_rejected_logp
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
