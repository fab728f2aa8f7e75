"""thinpipe.objective against TRL's own code (trl==1.16.0, the `peer` extra): GRPOTrainer._compute_loss (GSPO /
GRPO clipped loss, k3 KL), its group advantages, trl.rewards.get_soft_overlong_punishment, DPOTrainer._compute_loss
(sigmoid DPO) and accuracy_reward (math-verify), on identical inputs.

The trainers are built without __init__ (which needs a dataset, a tokenizer and reward functions): the instance
gets exactly the attributes __init__ copies from a real GRPOConfig / DPOConfig and that _compute_loss reads, a
single-process accelerator, and for the end-to-end cases a tiny float64 Llama with TRL's own fused LM head. Without
trl this file is skipped, except under CI=true, where a missing trl must fail.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("CI") == "true":
    import trl  # noqa: F401  (CI installs the `peer` extra: a missing trl is a failure there, not a skip)
else:
    pytest.importorskip("trl")

from trl import DPOConfig, GRPOConfig  # noqa: E402
from trl.rewards import accuracy_reward, get_soft_overlong_punishment  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head, entropy_from_logits, nanstd, selective_log_softmax  # noqa: E402

from thinpipe.models.presets import tiny_config  # noqa: E402
from thinpipe.objective import (  # noqa: E402
    dpo_loss,
    group_advantages,
    math_reward,
    overlong_penalty,
    policy_loss,
    response_logprobs,
    token_entropy,
)

# transformers 5.23 warns about a TrainingArguments field that GRPOConfig / DPOConfig still set by default
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

TRL_VERSION = "1.16.0"
EPS_LOW, EPS_HIGH = 3e-4, 4e-4  # App. D.4's clip ratios
D = torch.float64


def test_trl_is_the_pinned_version():
    # These tests read TRL internals (attribute names, the advantage block's source): another version may move them.
    import trl

    assert trl.__version__ == TRL_VERSION


class _SingleProcess:
    """accelerate's Accelerator on one process: gather / reduce are identities."""

    num_processes, process_index, sync_gradients, is_main_process = 1, 0, True, True
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def autocast(self):
        return contextlib.nullcontext()


def _grpo(tmp_path, level: str, beta: float = 0.0, model=None) -> GRPOTrainer:
    args = GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, loss_type="grpo",
                      importance_sampling_level=level, epsilon=EPS_LOW, epsilon_high=EPS_HIGH, beta=beta,
                      use_bias_correction_kl=False)
    tr = object.__new__(GRPOTrainer)
    tr.args = args
    # as GRPOTrainer.__init__ sets them from args
    tr.loss_type, tr.importance_sampling_level, tr.beta = args.loss_type, args.importance_sampling_level, args.beta
    tr.epsilon_low = args.epsilon
    tr.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    tr.top_entropy_quantile, tr.off_policy_mask_threshold = args.top_entropy_quantile, args.off_policy_mask_threshold
    tr.use_vllm, tr.vllm_importance_sampling_correction = args.use_vllm, args.vllm_importance_sampling_correction
    tr.entropy_coef, tr.use_adaptive_entropy = args.entropy_coef, args.use_adaptive_entropy
    tr._entropy_bonus_enabled = tr.entropy_coef != 0.0 or tr.use_adaptive_entropy
    tr.temperature = args.temperature
    tr.aux_loss_enabled = False
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    tr.current_gradient_accumulation_steps = 1
    tr.accelerator = _SingleProcess()
    tr.model = model if model is not None else torch.nn.Linear(1, 1)  # only .training is read
    tr.model.train()
    return tr


def _rows(lengths, seed=0):
    """Log-probs, old log-probs (log-ratios on both sides of each clip bound, at sequence and token level), masks,
    advantages: the same layout as tests/unit/objective/test_objective_math.py::_clip_rows."""
    g = torch.Generator().manual_seed(seed)
    seq_lr = [1e-3, 2e-4, -1e-3, -1e-4, -1e-3, 1e-3, 0.0, 0.0][:len(lengths)]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 0.7, 0.5][:len(lengths)], dtype=D)
    L = max(lengths)
    logp = torch.randn(len(lengths), L, generator=g, dtype=D) - 2
    mask = torch.zeros(len(lengths), L, dtype=torch.bool)
    lr = torch.zeros_like(logp)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
        if n:
            wiggle = torch.linspace(-1, 1, n, dtype=D) * (3e-4 if seq_lr[i] else 0.0)
            lr[i, :n] = seq_lr[i] + wiggle - wiggle.mean()
    zero = torch.zeros((), dtype=D)
    # TRL's fused head writes 0 at unlabelled positions; old log-probs come from the same head
    logp = torch.where(mask, logp, zero)
    return logp, torch.where(mask, logp - lr, zero), mask, adv


def _trl_policy(tmp_path, level, logp, old, mask, adv, beta=0.0, ref=None):
    tr = _grpo(tmp_path, level, beta)
    leaf = logp.clone().requires_grad_(True)
    tr._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, torch.zeros_like(leaf), None)
    b, L = logp.shape
    inputs = {"prompt_ids": torch.zeros(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.zeros(b, L, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old}
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = tr._compute_loss(tr.model, inputs)
    loss.backward()
    return loss.detach(), leaf.grad, tr._metrics["train"]


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_policy_loss_equals_trl_grpo_loss_and_gradient(tmp_path, level):
    logp, old, mask, adv = _rows([5, 3, 6, 2, 4, 6, 0, 3])
    want, want_grad, metrics = _trl_policy(tmp_path, level, logp, old, mask, adv)
    x = logp.clone().requires_grad_(True)
    ours, stats = policy_loss(x, old, mask, adv, EPS_LOW, EPS_HIGH, level=level)
    ours.mean().backward()  # TRL's "grpo" loss: the mean over sequences of each one's token mean
    torch.testing.assert_close(ours.mean().detach(), want, rtol=0, atol=1e-14)
    torch.testing.assert_close(x.grad, want_grad, rtol=0, atol=1e-14)
    assert (stats["low_clipped"] > 0) and (stats["high_clipped"] > 0)
    if level == "token":  # TRL's clip_ratio/*_mean are token means at token level
        tokens = stats["tokens"].item()  # (TRL divides by a float32 token count: 1e-7 rounding)
        assert metrics["clip_ratio/low_mean"][0] == pytest.approx(stats["low_clipped"].item() / tokens, abs=1e-6)
        assert metrics["clip_ratio/high_mean"][0] == pytest.approx(stats["high_clipped"].item() / tokens, abs=1e-6)
        assert metrics["clip_ratio/region_mean"][0] == pytest.approx(stats["clipped"].item() / tokens, abs=1e-6)


def test_sequence_level_clip_counts_equal_trl_on_equal_lengths(tmp_path):
    # TRL counts clipped sequences, thinpipe clipped tokens: with one length for all rows the fractions coincide
    logp, old, mask, adv = _rows([4] * 6)
    _, _, metrics = _trl_policy(tmp_path, "sequence", logp, old, mask, adv)
    _, stats = policy_loss(logp, old, mask, adv, EPS_LOW, EPS_HIGH, level="sequence")
    tokens = stats["tokens"].item()
    for key, name in (("low_clipped", "low_mean"), ("high_clipped", "high_mean"), ("clipped", "region_mean")):
        assert metrics[f"clip_ratio/{name}"][0] == pytest.approx(stats[key].item() / tokens, abs=1e-6)
    assert stats["low_clipped"].item() == 4 and stats["high_clipped"].item() == 4


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_policy_loss_kl_equals_trl_k3(tmp_path, level):
    logp, old, mask, adv = _rows([5, 3, 6, 2, 4, 6, 0, 3], seed=1)
    ref = torch.where(mask, logp + torch.linspace(-0.3, 0.3, logp.shape[1], dtype=D), torch.zeros((), dtype=D))
    want, want_grad, metrics = _trl_policy(tmp_path, level, logp, old, mask, adv, beta=0.04, ref=ref)
    x = logp.clone().requires_grad_(True)
    ours, stats = policy_loss(x, old, mask, adv, EPS_LOW, EPS_HIGH, level=level, ref_logp=ref, kl_beta=0.04)
    ours.mean().backward()
    torch.testing.assert_close(ours.mean().detach(), want, rtol=0, atol=1e-14)
    torch.testing.assert_close(x.grad, want_grad, rtol=0, atol=1e-14)
    assert metrics["kl"][0] == pytest.approx(stats["kl"].item() / stats["tokens"].item(), rel=1e-6)


def _float32_close(mine: torch.Tensor, theirs: torch.Tensor) -> None:
    """TRL's fused LM head projects in float32 tiles whatever the model's dtype, so end-to-end agreement is to
    float32 rounding (measured: 2e-8 on a loss, 1e-6 of a gradient's scale); the leaf tests above are exact."""
    mine, theirs = mine.detach().to(D), theirs.detach().to(D)
    scale = theirs.abs().max().item() if theirs.numel() else 0.0
    assert (mine - theirs).abs().max().item() <= 2e-5 * scale + 1e-7


def _tiny_llama_f64(outputs):
    config = tiny_config("llama")
    config._attn_implementation = "sdpa"  # (eager attention gives NaN rows for left padding in float64)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=D)
    add_fused_lm_head(model, outputs=outputs)
    return model


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_end_to_end_with_trl_fused_head_on_a_tiny_model(tmp_path, level):
    """TRL scores completions with its fused LM head (its real _get_per_token_logps_and_entropies); thinpipe with
    response_logprobs on the full logits. Same model, same old log-probs (set so rows fall on both sides of the
    clip bounds, >= 1e-4 away from them, far beyond float32 rounding): same loss, parameter gradients, entropies."""
    model = _tiny_llama_f64(("log_probs", "entropy"))
    g = torch.Generator().manual_seed(3)
    b, p, c = 6, 4, 5
    prompt = torch.randint(0, 512, (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding, as TRL pads prompts
    completion = torch.randint(0, 512, (b, c), generator=g)
    lengths = [5, 3, 5, 2, 4, 5]
    completion_mask = (torch.arange(c)[None] < torch.tensor(lengths)[:, None]).long()
    input_ids, attention = torch.cat([prompt, completion], 1), torch.cat([prompt_mask, completion_mask], 1)
    labels = input_ids.masked_fill(attention == 0, -100)
    labels[:, :p] = -100
    mask = completion_mask.bool()

    def ours():
        logits = model(input_ids=input_ids, attention_mask=attention).logits
        logp, m = response_logprobs(logits, labels)
        return logp[:, -c:], m[:, -c:], token_entropy(logits, labels)[:, -c:]

    with torch.no_grad():
        cur, m, _ = ours()
    assert torch.equal(m, mask)
    target = torch.tensor([1e-3, 2e-4, -1e-3, -1e-4, -1e-3, 1e-3], dtype=D)[:, None]
    old = torch.where(mask, cur - target, torch.zeros((), dtype=D))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0], dtype=D)

    tr = _grpo(tmp_path, level, model=model)
    inputs = {"prompt_ids": prompt, "prompt_mask": prompt_mask, "completion_ids": completion,
              "completion_mask": completion_mask, "advantages": adv, "old_per_token_logps": old}
    model.zero_grad()
    trl_loss = tr._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = [q.grad.clone() for q in model.parameters()]
    model.zero_grad()
    logp, _, ent = ours()
    loss, _ = policy_loss(logp, old, mask, adv, EPS_LOW, EPS_HIGH, level=level)
    loss.mean().backward()
    _float32_close(loss.mean(), trl_loss)
    for mine, theirs in zip((q.grad for q in model.parameters()), trl_grads):
        _float32_close(mine, theirs)
    trl_logp, trl_ent, _ = tr._get_per_token_logps_and_entropies(model, input_ids, attention, c, compute_entropy=True)
    _float32_close(logp, trl_logp * mask)
    _float32_close(ent, trl_ent * mask)


def test_logprobs_and_entropy_equal_trl_utilities():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 7, 11, generator=g, dtype=D) * 3
    labels = torch.randint(0, 11, (3, 7), generator=g)
    logp, _ = response_logprobs(logits, labels)
    torch.testing.assert_close(logp, selective_log_softmax(logits[:, :-1], labels[:, 1:]), rtol=0, atol=1e-12)
    torch.testing.assert_close(token_entropy(logits, labels), entropy_from_logits(logits[:, :-1]), rtol=0, atol=1e-12)


def _trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """Run TRL's own advantage lines (GRPOTrainer._generate_and_score_completions, sum_then_normalize branch)."""
    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    first = next(i for i, ln in enumerate(lines) if "mean_grouped_rewards = torch.nanmean(" in ln)
    last = next(i for i in range(first, len(lines)) if "is_std_zero =" in lines[i])
    block = textwrap.dedent("\n".join(lines[first:last]))
    assert "advantages = advantages / (std_rewards + 1e-4)" in block
    scope = {"torch": torch, "nanstd": nanstd, "rewards": rewards, "num_generations": num_generations,
             "self": SimpleNamespace(scale_rewards=scale_rewards)}
    exec(block, scope)  # noqa: S102  (TRL's source text, from the installed package)
    return scope["advantages"]


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_equal_trl(scale):
    g = torch.Generator().manual_seed(2)
    binary = (torch.rand(64, generator=g) > 0.6).float()  # 0/1 verifiable rewards, some flat groups of 16
    binary[:16] = 1.0
    shaped = binary + torch.tensor([-0.25, 0.0, -0.5, 0.0] * 16)  # with an overlong penalty on top
    for rewards, size in ((binary, 16), (shaped, 16), (shaped, 4), (torch.randn(12, generator=g, dtype=D), 3)):
        want = _trl_advantages(rewards, size, "group" if scale else "none")
        torch.testing.assert_close(group_advantages(rewards, size, scale=scale), want.to(rewards.dtype),
                                   rtol=1e-6, atol=1e-6)
    assert torch.all(_trl_advantages(binary, 16, "group")[:16] == 0)


def test_overlong_penalty_equals_trl_soft_overlong_punishment():
    for max_len, cache, penalty in ((7680, 3584, 1.0), (100, 20, 0.5), (64, 64, 2.0), (10, 1, 1.0)):
        trl_fn = get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=cache)
        lengths = sorted({0, 1, max_len - cache - 1, max_len - cache, max_len - cache + 1, max_len - cache // 2,
                          max_len - 1, max_len, max_len + 1, 2 * max_len})
        lengths = [n for n in lengths if n >= 0]
        theirs = trl_fn([[0] * n for n in lengths])  # TRL's reward is in [-1, 0]; ours is scaled by the penalty
        ours = [overlong_penalty(n, max_len, cache, penalty) for n in lengths]
        assert ours == pytest.approx([t * penalty for t in theirs], abs=1e-15), (max_len, cache)


def _dpo(tmp_path, model) -> DPOTrainer:
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, beta=0.1, precompute_ref_log_probs=True)
    tr = object.__new__(DPOTrainer)
    tr.args, tr.model, tr.accelerator = args, model, _SingleProcess()
    # as DPOTrainer.__init__ sets them from args
    tr.beta, tr.precompute_ref_logps, tr.loss_types = args.beta, args.precompute_ref_log_probs, args.loss_type
    tr.loss_weights = args.loss_weights or [1.0] * len(tr.loss_types)
    tr.ld_alpha, tr.f_divergence_type = args.ld_alpha, args.f_divergence_type
    tr.f_alpha_divergence_coef, tr.label_smoothing = args.f_alpha_divergence_coef, args.label_smoothing
    tr.use_weighting, tr.aux_loss_enabled, tr._total_train_tokens, tr._tp_size = args.use_weighting, False, 0, 1
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    assert tr.loss_types == ["sigmoid"] and tr.label_smoothing == 0.0 and tr.f_divergence_type == "reverse_kl"
    model.train()
    return tr


def _dpo_batch(pairs: int = 3, t: int = 9):
    g = torch.Generator().manual_seed(4)
    input_ids = torch.randint(0, 512, (2 * pairs, t), generator=g)  # [chosen..., rejected...]
    completion_mask = torch.zeros(2 * pairs, t, dtype=torch.long)
    for i, (start, end) in enumerate([(3, 9), (4, 8), (2, 9), (3, 7), (4, 9), (2, 6)][:2 * pairs]):
        completion_mask[i, start:end] = 1
    ref = torch.randn(2 * pairs, generator=g, dtype=D) * 2 - 30
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "completion_mask": completion_mask,
            "ref_chosen_logps": ref[:pairs], "ref_rejected_logps": ref[pairs:]}


class _GivenLogProbs(torch.nn.Module):
    """A policy whose fused head returns the given per-token log-probs: TRL's DPO math on exact inputs."""

    def __init__(self, log_probs: torch.Tensor):
        super().__init__()
        self.log_probs = torch.nn.Parameter(log_probs.clone())

    def forward(self, input_ids, labels, **_):
        n = labels.shape[1] - 1
        zeros = torch.zeros(labels.shape[0], n, dtype=D)
        return SimpleNamespace(log_probs=self.log_probs * (labels[:, 1:] != -100), entropy=zeros, mean_logits=zeros,
                               is_top1=zeros.bool(), aux_loss=None)


def test_dpo_loss_equals_trl_dpo_trainer_exactly(tmp_path):
    inputs = _dpo_batch()
    pairs = inputs["ref_chosen_logps"].shape[0]
    g = torch.Generator().manual_seed(6)
    per_token = torch.randn(2 * pairs, inputs["input_ids"].shape[1] - 1, generator=g, dtype=D) - 4
    tr = _dpo(tmp_path, _GivenLogProbs(per_token))
    trl_loss = tr._compute_loss(tr.model, inputs, return_outputs=False)
    trl_loss.backward()
    mask = inputs["completion_mask"][:, 1:].bool()
    x = per_token.clone().requires_grad_(True)
    seq = (x * mask).sum(-1)
    ref_c, ref_r = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
    losses, chosen_r, rejected_r = dpo_loss(seq[:pairs], seq[pairs:], ref_c, ref_r, tr.beta)
    losses.mean().backward()  # TRL: the mean over pairs
    torch.testing.assert_close(losses.mean().detach(), trl_loss.detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(x.grad, tr.model.log_probs.grad, rtol=0, atol=1e-14)
    m = tr._metrics["train"]
    assert m["rewards/chosen"][0] == pytest.approx(chosen_r.mean().item(), abs=1e-12)
    assert m["rewards/rejected"][0] == pytest.approx(rejected_r.mean().item(), abs=1e-12)
    assert m["rewards/margins"][0] == pytest.approx((chosen_r - rejected_r).mean().item(), abs=1e-12)
    assert m["rewards/accuracies"][0] == pytest.approx((chosen_r > rejected_r).double().mean().item(), abs=1e-7)


def test_dpo_loss_equals_trl_dpo_trainer_on_a_tiny_model(tmp_path):
    """End to end: TRL's fused head on a tiny Llama vs response_logprobs on its full logits, summed per response."""
    model = _tiny_llama_f64(("log_probs", "entropy", "mean_logits", "is_top1"))
    tr = _dpo(tmp_path, model)
    inputs = _dpo_batch()
    pairs = inputs["ref_chosen_logps"].shape[0]
    trl_loss = tr._compute_loss(model, inputs, return_outputs=False)
    trl_loss.backward()
    trl_grads = [q.grad.clone() for q in model.parameters()]

    model.zero_grad()
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    logp, _ = response_logprobs(model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits,
                                labels)
    seq = logp.sum(-1)
    losses, chosen_r, _ = dpo_loss(seq[:pairs], seq[pairs:], inputs["ref_chosen_logps"],
                                   inputs["ref_rejected_logps"], tr.beta)
    losses.mean().backward()
    _float32_close(losses.mean(), trl_loss)
    for mine, theirs in zip((q.grad for q in model.parameters()), trl_grads):
        _float32_close(mine, theirs)
    assert tr._metrics["train"]["rewards/chosen"][0] == pytest.approx(chosen_r.mean().item(), abs=1e-6)


@pytest.mark.parametrize("completion,solution", [
    (r"So the result is $\boxed{\frac{1}{3}}$.", r"\frac{1}{3}"),
    (r"So the result is $\boxed{\frac{1}{2}}$.", r"\frac{1}{3}"),
    (r"We get $\boxed{0.5}$", r"\frac{1}{2}"),
    (r"Thus $x = \boxed{2\sqrt{2}}$", r"\sqrt{8}"),
    (r"The area is $\boxed{2\pi}$", r"2\pi"),
    (r"The final answer is $\boxed{12}$", "12"),
    (r"The final answer is $\boxed{13}$", "12"),
])
def test_math_reward_agrees_with_trl_accuracy_reward(completion, solution):
    """On boxed LaTeX completions (the only kind TRL's accuracy_reward extracts). TRL parses the gold answer as
    given, where bare LaTeX (\\sqrt{8}, 2\\pi) is not read or misread; thinpipe reads a bare gold answer as
    $...$, so TRL is handed that form."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("math_verify")
    want = accuracy_reward([[{"role": "assistant", "content": completion}]], [f"${solution}$"])[0]
    assert want is not None and math_reward(completion, solution) == want
