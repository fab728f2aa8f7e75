"""How much of a GSPO step's gradient is signal, at the SFT start (issue 40: why no setting gained yet).

On-policy (the first update of a step, importance ratio 1) GSPO's gradient with seq-mean-token-mean is
``g = -(1/N) sum_i A_i (1/|y_i|) sum_t grad log pi(y_it)`` (anchor-priors App. D; GSPO §4.2), A the group-standardised
advantages. Each batch of ``--prompts`` fresh training prompts x ``--group`` rollouts (T = 1, as the runs sample)
gives one estimate; two independent estimates share only the true gradient mu, so at batch size B

    E[g_a . g_b] = |mu|^2,   E|g|^2 = |mu|^2 + sigma^2 / B,   cos(g_a, g_b) ~= 1 / (1 + (sigma^2/|mu|^2) / B),

and the batch at which a step's direction is half signal (cos = 0.5) is ``B* = B (1/cos - 1)``; with few batches
the pairs' cosines scatter widely, so the file gives B* from the mean's upper 1-stderr bound, as "at least". Each
batch is also split in halves (same prompts' groups, B/2 rollouts) to check the 1/B scaling. HF ``generate``
samples, the model's own forward scores (``eval_heldout.load``), ``math_reward`` rewards, ``group_advantages``
advantages.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/grad_snr.py --init /work/rl_runs/sft_Dense \\
        --out experiments/rl/results/grad_snr.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

import torch

from thinpipe.provenance import code_stamp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from eval_heldout import generate, load  # noqa: E402

from thinpipe.data.chat import prompt_text  # noqa: E402
from thinpipe.objective.losses import group_advantages  # noqa: E402
from thinpipe.objective.rewards import math_reward  # noqa: E402


def batch_gradient(model, tok, rows: list[dict], group: int, max_new: int, seed: int) -> tuple[list, dict]:
    """(gradients of the two halves of the batch, flattened fp32 on CPU; stats) for one batch of prompts."""
    prompts = [r["prompt"] for r in rows for _ in range(group)]
    comps = generate(model, tok, prompts, max_new, batch=len(prompts), sample=True, seed=seed)
    rewards = torch.tensor([math_reward(c, r["answer"]) for c, r in zip(comps, [r for r in rows for _ in
                                                                                  range(group)])])
    adv = group_advantages(rewards.float(), group, True)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    halves = []
    n = len(prompts)
    for part in (range(0, n // 2), range(n // 2, n)):
        model.zero_grad(set_to_none=True)
        for i in part:
            if adv[i] == 0:
                continue
            p = tok.encode(prompt_text(prompts[i]), add_special_tokens=False)
            y = tok.encode(comps[i], add_special_tokens=False) + [end]
            ids = torch.tensor([p + y])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(p) - 1:-1].float(), -1)
            tok_logp = logp.gather(1, torch.tensor(y)[:, None]).squeeze(1)
            (-(adv[i] * tok_logp.mean()) / len(part)).backward()
        halves.append(torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).flatten().float()
                                 for q in model.parameters()]))
    zero = float((rewards.view(-1, group).std(dim=1) == 0).float().mean())
    return halves, {"reward": float(rewards.mean()), "frac_reward_zero_std": zero}


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30))


def mean_se(v: list[float]) -> tuple[float, float]:
    m = sum(v) / len(v)
    return m, (sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v)) ** 0.5 if len(v) > 1 else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", default="/work/rl_runs/sft_Dense")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results" / "grad_snr.json"))
    a = ap.parse_args()
    rows = [json.loads(x) for x in (HERE / "data" / "rl_train.jsonl").read_text().splitlines() if x.strip()]
    random.Random(a.seed).shuffle(rows)
    model, tok = load(a.init)
    model.float()
    t0 = time.time()
    grads, stats = [], []
    for k in range(a.batches):
        halves, st = batch_gradient(model, tok, rows[k * a.prompts:(k + 1) * a.prompts], a.group, a.max_new,
                                    a.seed + k)
        grads.append(halves)
        stats.append(st)
        print(f"batch {k}: reward {st['reward']:.3f}, zero-std groups {st['frac_reward_zero_std']:.2f} "
              f"({time.time() - t0:.0f} s)", flush=True)
    full = [h[0] + h[1] for h in grads]  # each half is already divided by its own size: the mean of the halves x 2
    b = a.prompts * a.group
    cos_full = [cos(x, y) for x, y in itertools.combinations(full, 2)]
    cos_half = [cos(x[i], y[j]) for x, y in itertools.combinations(grads, 2) for i in (0, 1) for j in (0, 1)]
    c_full, se_full = mean_se(cos_full)
    c_half, se_half = mean_se(cos_half)
    upper = c_full + se_full  # the pairs share batches: their stderr is a rough one
    res = {"init": a.init, "prompts_per_batch": a.prompts, "group": a.group, "rollouts_per_batch": b,
           "batches": stats, "cos_between_batches": {"B": b, "mean": c_full, "stderr": se_full, "pairs": cos_full},
           "cos_between_half_batches": {"B": b // 2, "mean": c_half, "stderr": se_half, "pairs": cos_half},
           "rollouts_for_cos_0.5_at_least": b * (1 / upper - 1) if 0 < upper < 1 else None,
           "wall_s": time.time() - t0, **code_stamp()}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"cos between independent batches: B = {b}: {c_full:.3f} +- {se_full:.3f}; B = {b // 2}: {c_half:.3f} +- "
          f"{se_half:.3f}; rollouts per update for a half-signal direction: at least "
          f"{res['rollouts_for_cos_0.5_at_least']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
