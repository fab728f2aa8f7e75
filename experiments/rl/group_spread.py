"""How much learning signal a GSPO step gets from a start, by group size (issue 40: "say what mattered").

A group whose rollouts all earn the same reward has zero advantage and teaches nothing (TRL's
``frac_reward_zero_std``). From ``eval_heldout.py``'s sampling of K rollouts per prompt at temperature 1 (K = 16
here), this computes exactly, per prompt with k of K correct, the chance that a group of G drawn from those K
(without replacement, hypergeometric) is all right or all wrong, and averages over prompts: the expected share of
zero-advantage groups at G = 2, 4, 8, 16, and the expected rollouts with a non-zero advantage per step of P prompts.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/eval_heldout.py --model /work/rl_runs/sft_Dense \\
        --data experiments/rl/data/rl_train.jsonl --limit 48 --samples 16 --sample-prompts 48 \\
        --max-new-tokens 64 --out experiments/rl/results/group_spread.json
    .venv/bin/python experiments/rl/group_spread.py        # adds "zero_std" to results/group_spread.json
"""

from __future__ import annotations

import argparse
import json
from math import comb
from pathlib import Path

from thinpipe.provenance import code_stamp

HERE = Path(__file__).resolve().parent


def zero_std_chance(k: int, n: int, g: int) -> float:
    """P(a group of g drawn without replacement from n rollouts, k of them correct, is all correct or all wrong)."""
    return (comb(k, g) + comb(n - k, g)) / comb(n, g)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", default=str(HERE / "results" / "group_spread.json"))
    ap.add_argument("--prompts-per-step", type=int, default=4)
    a = ap.parse_args()
    path = Path(a.file)
    saved = json.loads(path.read_text())
    for name, res in saved["results"].items():
        groups = res["sampling"]["groups"]
        n = res["sampling"]["k"]
        ks = [sum(g["correct"]) for g in groups]
        table = {}
        for g in (2, 4, 8, 16):
            if g > n:
                continue
            frac = sum(zero_std_chance(k, n, g) for k in ks) / len(ks)
            table[str(g)] = {"frac_reward_zero_std": frac,
                             "rollouts_with_signal_per_step": a.prompts_per_step * g * (1 - frac)}
            print(f"{name}: G={g:2d}: expected zero-advantage groups {frac:.3f}, rollouts with signal per step of "
                  f"{a.prompts_per_step} prompts {a.prompts_per_step * g * (1 - frac):.1f}")
        res["zero_std"] = {"prompts": len(ks), "samples_per_prompt": n, "per_prompt_correct": ks,
                           "prompts_per_step": a.prompts_per_step, "by_group_size": table, **code_stamp()}
    path.write_text(json.dumps(saved, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
