"""thinpipe.objective against hand computation: every expected value comes from plain-Python loops over the same
numbers (math.exp / math.log / statistics), never from the functions under test."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from thinpipe.config import ConfigError
from thinpipe.models.stages import next_token_loss
from thinpipe.objective import losses, rewards
from thinpipe.objective.losses import dpo_loss, group_advantages, policy_loss, response_logprobs, token_entropy
from thinpipe.objective.rewards import extract_answer, math_reward, overlong_penalty

D = torch.float64


def _logits_labels(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 5, 7, generator=g, dtype=D) * 2
    labels = torch.tensor([[3, 1, 6, -100, 2], [-100, -100, 0, 5, -100]])
    return logits, labels


def _log_softmax_row(row: list[float]) -> list[float]:
    top = max(row)
    lse = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - lse for x in row]


# ------------------------------------------------------------------------------------- log-probs, entropy

def test_response_logprobs_by_hand():
    logits, labels = _logits_labels()
    logp, mask = response_logprobs(logits, labels)
    assert logp.shape == mask.shape == (2, 4) and logp.dtype == D and mask.dtype == torch.bool
    for b in range(2):
        for j in range(4):
            nxt = int(labels[b, j + 1])
            assert bool(mask[b, j]) == (nxt != -100)
            want = _log_softmax_row(logits[b, j].tolist())[nxt] if nxt != -100 else 0.0
            assert logp[b, j].item() == pytest.approx(want, abs=1e-12)


def test_response_logprobs_matches_next_token_loss_and_its_gradient():
    logits, labels = _logits_labels(1)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    logp, _ = response_logprobs(a, labels)
    logp.sum().backward()
    (-next_token_loss(b, labels)).backward()
    assert logp.sum().item() == pytest.approx(-next_token_loss(logits, labels).item(), abs=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


def test_response_logprobs_gradcheck_and_low_precision_reads_float32():
    logits, labels = _logits_labels(2)
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: response_logprobs(t, labels)[0], (x,))
    logp16, _ = response_logprobs(logits.to(torch.bfloat16), labels)
    assert logp16.dtype == torch.float32
    ref, _ = response_logprobs(logits.to(torch.bfloat16).to(D), labels)
    torch.testing.assert_close(logp16.to(D), ref, rtol=0, atol=1e-5)


def test_token_entropy_by_hand():
    logits, labels = _logits_labels(3)
    ent = token_entropy(logits, labels)
    assert ent.shape == (2, 4) and not ent.requires_grad
    for b in range(2):
        for j in range(4):
            lp = _log_softmax_row(logits[b, j].tolist())
            want = -sum(math.exp(v) * v for v in lp) if int(labels[b, j + 1]) != -100 else 0.0
            assert ent[b, j].item() == pytest.approx(want, abs=1e-12)


# -------------------------------------------------------------------------------------------- advantages

def test_group_advantages_by_hand_and_zero_spread():
    r = [1.0, 0.0, 0.0, 1.0, 0.0, 0.25, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 3.0, -1.0, 0.5, 2.0, 0.0, 0.0]
    adv = group_advantages(torch.tensor(r, dtype=D), 6)
    adv_raw = group_advantages(torch.tensor(r, dtype=D), 6, scale=False)
    for g in range(3):
        grp = r[6 * g:6 * g + 6]
        mu, sd = statistics.fmean(grp), statistics.stdev(grp)  # stdev: unbiased (n - 1)
        for k, x in enumerate(grp):
            want = 0.0 if max(grp) == min(grp) else (x - mu) / (sd + 1e-4)
            want_raw = 0.0 if max(grp) == min(grp) else x - mu
            assert adv[6 * g + k].item() == pytest.approx(want, abs=1e-12)
            assert adv_raw[6 * g + k].item() == pytest.approx(want_raw, abs=1e-12)
    assert torch.all(adv[6:12] == 0) and torch.all(adv_raw[6:12] == 0)  # exactly zero, float32 too:
    assert torch.all(group_advantages(torch.full((8,), 0.1), 4) == 0)
    assert torch.all(group_advantages(torch.tensor([0.3, 0.7]), 1) == 0)  # a group of one has no spread


def test_group_advantages_rejects_a_group_size_that_does_not_divide():
    with pytest.raises(ConfigError, match="does not divide"):
        group_advantages(torch.zeros(10), 4)


# ------------------------------------------------------------------------------------------- policy loss

def _ref_policy(lp, old, mask, adv, lo, hi, level, ref=None, beta=0.0):
    """Plain-Python loss per sequence, d loss / d logp, and the clip counts (TRL's is_low/high_clipped)."""
    losses_, grads, low, high = [], [], 0, 0
    for i, a in enumerate(adv):
        idx = [t for t, m in enumerate(mask[i]) if m]
        n = len(idx)
        grad = [0.0] * len(mask[i])
        if n == 0:
            losses_.append(0.0)
            grads.append(grad)
            continue
        seq_ratio = math.exp(sum(lp[i][t] - old[i][t] for t in idx) / n)
        total = 0.0
        for t in idx:
            c = seq_ratio if level == "sequence" else math.exp(lp[i][t] - old[i][t])
            cc = min(max(c, 1 - lo), 1 + hi)
            unclipped = c * a <= cc * a
            total += -min(c * a, cc * a)
            # unclipped: d(-c A)/d lp_t is -A c per token (token level), -A s for each token's share of s
            grad[t] += (-a * c / n) if unclipped else 0.0
            low += c < 1 - lo and a < 0
            high += c > 1 + hi and a > 0
            if beta:
                d = ref[i][t] - lp[i][t]
                total += beta * (math.exp(d) - d - 1)
                grad[t] += beta * (1 - math.exp(d)) / n
        losses_.append(total / n)
        grads.append(grad)
    return losses_, grads, low, high


def _clip_rows(scale: float = 1.0):
    """Rows on both sides of each bound of the (3e-4, 4e-4) window of App. D.4 at sequence level (log-ratios
    times ``scale``: 600 for a (0.2, 0.28) window); token log-ratios spread around each row's mean so the token
    level sees ratios on both sides too. Row 6 has no token, row 7 has ratio 1."""
    g = torch.Generator().manual_seed(7)
    seq_lr = [s * scale for s in (1e-3, 2e-4, -1e-3, -1e-4, -1e-3, 1e-3, 0.0, 0.0)]
    adv = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 0.7, 0.5]
    lengths = [5, 3, 6, 2, 4, 6, 0, 3]
    L = 6
    old = torch.randn(8, L, generator=g, dtype=D) - 2
    mask = torch.zeros(8, L, dtype=torch.bool)
    lr = torch.zeros(8, L, dtype=D)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
        if n:
            wiggle = torch.linspace(-1, 1, n, dtype=D) * (0 if i == 7 else 3e-4 * scale)
            lr[i, :n] = seq_lr[i] + wiggle - wiggle.mean()
    logp = torch.where(mask, old + lr, torch.zeros((), dtype=D))
    return logp, old, mask, torch.tensor(adv, dtype=D)


@pytest.mark.parametrize("level", ["sequence", "token"])
@pytest.mark.parametrize("window", [(3e-4, 4e-4, 1.0), (0.2, 0.28, 600.0)])
def test_policy_loss_by_hand(level, window):
    lo, hi, scale = window
    logp, old, mask, adv = _clip_rows(scale)
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(x, old, mask, adv, lo, hi, level=level)
    loss.sum().backward()
    want, want_grad, low, high = _ref_policy(logp.tolist(), old.tolist(), mask.tolist(), adv.tolist(), lo, hi, level)
    torch.testing.assert_close(loss.detach(), torch.tensor(want, dtype=D), rtol=0, atol=1e-13)
    torch.testing.assert_close(x.grad, torch.tensor(want_grad, dtype=D), rtol=0, atol=1e-13)
    assert stats["tokens"].item() == sum(sum(r) for r in mask.tolist())
    assert (stats["low_clipped"].item(), stats["high_clipped"].item()) == (low, high)
    assert stats["clipped"].item() == low + high
    assert stats["log_ratio_abs_max"].item() == max(abs(a - b) for ra, rb, rm in zip(logp.tolist(), old.tolist(),
                                                    mask.tolist()) for a, b, m in zip(ra, rb, rm) if m)
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())
    if level == "sequence":
        # rows 0 (A > 0, above 1 + hi) and 2 (A < 0, below 1 - lo) are clipped: no gradient, loss at the bound
        assert (low, high) == (6, 5) and torch.all(x.grad[[0, 2]] == 0)
        assert loss[0].item() == pytest.approx(-(1 + hi), abs=1e-15)
        assert loss[2].item() == pytest.approx(1 - lo, abs=1e-15)
        assert torch.all(x.grad[[1, 3, 4, 5, 7]][mask[[1, 3, 4, 5, 7]]] != 0)  # the other sides keep it
    else:
        # token level: all of rows 0 and 2, plus row 1's last token (above) and row 3's first (below); rows 4
        # and 5 lie beyond a bound on the side where the min keeps the unclipped term, so they keep a gradient
        assert (low, high) == (7, 6)
        assert x.grad[1, 2] == 0 and x.grad[3, 0] == 0 and x.grad[1, 1] != 0 and x.grad[3, 1] != 0
        assert torch.all(x.grad[[4, 5]][mask[[4, 5]]] != 0)
    assert loss[6].item() == 0.0 and torch.all(x.grad[6] == 0)


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_policy_loss_ratio_one_is_minus_advantage(level):
    _, old, mask, adv = _clip_rows()
    loss, stats = policy_loss(old.clone(), old, mask, adv, 3e-4, 4e-4, level=level)
    has = mask.any(-1)
    torch.testing.assert_close(loss[has], -adv[has], rtol=0, atol=1e-15)
    assert loss[~has].item() == 0.0
    assert stats["clipped"].item() == 0 and stats["log_ratio_abs_max"].item() == 0


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_policy_loss_gradcheck_finite_differences(level):
    """The stop-gradient sequence form must give the true gradient of -min(s A, clip(s) A) (GSPO §4.2); finite
    differences of the loss value check it. Rows are >= 5e-5 from the bounds, far beyond the 1e-6 steps."""
    logp, old, mask, adv = _clip_rows()
    ref = old - 0.05
    x = logp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: policy_loss(t, old, mask, adv, 3e-4, 4e-4, level=level,
                                                          ref_logp=ref, kl_beta=0.1)[0], (x,))


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_policy_loss_kl_by_hand(level):
    logp, old, mask, adv = _clip_rows()
    ref = old + torch.linspace(-0.3, 0.3, old.shape[1], dtype=D)
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(x, old, mask, adv, 0.2, 0.28, level=level, ref_logp=ref, kl_beta=0.05)
    loss.sum().backward()
    want, want_grad, _, _ = _ref_policy(logp.tolist(), old.tolist(), mask.tolist(), adv.tolist(), 0.2, 0.28,
                                        level, ref=ref.tolist(), beta=0.05)
    torch.testing.assert_close(loss.detach(), torch.tensor(want, dtype=D), rtol=0, atol=1e-13)
    torch.testing.assert_close(x.grad, torch.tensor(want_grad, dtype=D), rtol=0, atol=1e-13)
    kl = sum(math.exp(r - p) - (r - p) - 1 for rr, rp, rm in zip(ref.tolist(), logp.tolist(), mask.tolist())
             for r, p, m in zip(rr, rp, rm) if m)
    assert stats["kl"].item() == pytest.approx(kl, abs=1e-13)


def test_policy_loss_padding_may_hold_anything():
    logp, old, mask, adv = _clip_rows()
    bad_old = old.masked_fill(~mask, float("-inf"))
    bad_logp = logp.masked_fill(~mask, float("nan")).requires_grad_(True)
    loss, stats = policy_loss(bad_logp, bad_old, mask, adv, 3e-4, 4e-4, ref_logp=bad_old, kl_beta=0.1)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(bad_logp.grad).all()
    assert torch.isfinite(torch.stack(list(stats.values()))).all()
    assert torch.all(bad_logp.grad[~mask] == 0)


def test_policy_loss_bad_settings_are_config_errors():
    logp, old, mask, adv = _clip_rows()
    with pytest.raises(ConfigError, match="level"):
        policy_loss(logp, old, mask, adv, 0.2, 0.2, level="tokens")
    with pytest.raises(ConfigError, match="clip"):
        policy_loss(logp, old, mask, adv, -0.1, 0.2)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, mask, adv, 0.2, 0.2, kl_beta=0.1)


# --------------------------------------------------------------------------------------------------- DPO

def test_dpo_loss_by_hand_with_gradients():
    c, r = [-10.0, -3.5, -7.25], [-9.0, -8.0, -7.0]
    rc, rr = [-10.5, -4.0, -7.0], [-8.5, -8.25, -7.5]
    beta = 0.1
    t = [torch.tensor(v, dtype=D, requires_grad=True) for v in (c, r)]
    out, cr, rw = dpo_loss(t[0], t[1], torch.tensor(rc, dtype=D), torch.tensor(rr, dtype=D), beta)
    out.sum().backward()
    for i in range(3):
        z = beta * ((c[i] - rc[i]) - (r[i] - rr[i]))
        assert out[i].item() == pytest.approx(math.log1p(math.exp(-z)), abs=1e-14)  # -log sigmoid(z)
        assert cr[i].item() == pytest.approx(beta * (c[i] - rc[i]), abs=1e-14)
        assert rw[i].item() == pytest.approx(beta * (r[i] - rr[i]), abs=1e-14)
        d = beta / (1 + math.exp(z))  # -d/dz log sigmoid(z) = sigmoid(-z)
        assert t[0].grad[i].item() == pytest.approx(-d, abs=1e-14)
        assert t[1].grad[i].item() == pytest.approx(d, abs=1e-14)
    assert not cr.requires_grad and not rw.requires_grad
    with pytest.raises(ConfigError, match="beta"):
        dpo_loss(t[0], t[1], t[0], t[1], 0.0)


# ----------------------------------------------------------------------------------------------- rewards

def test_overlong_penalty_by_hand():
    # App. D.3's setting: max 7680, buffer 3584, factor 1.0 (no penalty up to 4096 tokens)
    for n, want in [(0, 0.0), (4096, 0.0), (4097, -1 / 3584), (5888, -0.5), (7680, -1.0), (9000, -1.0)]:
        assert overlong_penalty(n, 7680, 3584, 1.0) == pytest.approx(want, abs=1e-15)
    for n, want in [(80, 0.0), (90, -0.25), (95, -0.375), (100, -0.5), (101, -0.5)]:
        assert overlong_penalty(n, 100, 20, 0.5) == pytest.approx(want, abs=1e-15)
    assert all(overlong_penalty(n, 100, 0, 1.0) == 0.0 for n in (0, 100, 10_000))  # buffer 0: off
    with pytest.raises(ConfigError, match="exceeds"):
        overlong_penalty(10, 100, 200, 1.0)


_BOTH_PATHS = [
    ("The answer is 12.0", "12", 1.0),
    ("So she pays $1,200 in total. The answer is 1,200.", "1200", 1.0),
    ("Adding up: 3 + 4 = 7.\n#### 7", "7", 1.0),
    ("The answer is -3.", "-3", 1.0),
    ("I think it is 5", "6", 0.0),
    ("The answer is 12.5", "12", 0.0),
    ("The answer is 0.01", "0", 0.0),
    ("no idea", "3", 0.0),
]


@pytest.fixture(params=["math-verify", "fallback"])
def path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(rewards, "_math_verify", lambda: None)
    else:
        pytest.importorskip("math_verify")
    return request.param


@pytest.mark.parametrize("completion,answer,want", _BOTH_PATHS)
def test_math_reward_both_paths(path, completion, answer, want):
    assert math_reward(completion, answer) == want


def test_extract_answer_both_paths(path):
    assert extract_answer("The answer is $1,234.") == "1234"
    assert extract_answer("nothing numeric") is None


def test_math_reward_symbolic_equivalence_needs_math_verify(path):
    # 1/2 boxed vs 0.5: only symbolic comparison sees it (the GSM8K path reads the last number, 2)
    assert math_reward(r"so $\boxed{\frac{1}{2}}$", "0.5") == (1.0 if path == "math-verify" else 0.0)


def test_math_reward_falls_back_when_math_verify_fails(monkeypatch):
    def broken(*_a, **_k):
        raise RuntimeError("parser blew up")

    monkeypatch.setattr(rewards, "_math_verify", lambda: (broken, broken, []))
    assert math_reward("The answer is 1,200", "1200.0") == 1.0
    assert math_reward("The answer is 1,201", "1200") == 0.0
    assert extract_answer("The answer is 8.") == "8"


def test_losses_module_imports_only_what_it_may():
    allowed = {"torch", "thinpipe", "__future__"}
    for mod in (losses, rewards):
        src = open(mod.__file__).read().splitlines()
        tops = {ln.split()[1].split(".")[0] for ln in src if ln.startswith(("import ", "from "))}
        assert tops <= allowed | {"functools", "math", "threading", "typing"}, tops
