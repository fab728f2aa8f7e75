"""The prompt draw of the gain runs (README "Issue 40", thinpipe vs TRL): for each run, the share of two-step problems
among the prompts of steps 1-5 and 16-20 and the reward the *starting* policy would expect on them (its greedy
per-template held-out accuracy, ``results/gain_heldout.json``), so that a difference between two runs' rollout
reward curves can be split into what the prompt draw explains and what it does not. thinpipe's order:
``thinpipe.data.prompts.prompt_batches`` (seeded by ``train.seed``); TRL's: its ``RepeatSampler`` (``torch.randperm``
seeded by ``GRPOConfig.seed``, 8 prompts a generation).

    .venv/bin/python experiments/rl/prompt_mix.py
"""

import json
from pathlib import Path

import torch

from thinpipe.data.prompts import prompt_batches

HERE = Path(__file__).resolve().parent
TWO_STEP = {"add_sub", "sub_sub", "mul_add", "mul_sub", "three"}


def main() -> None:
    rows = [json.loads(x) for x in (HERE / "data" / "rl_train.jsonl").read_text().splitlines() if x.strip()]
    acc = json.loads((HERE / "results" / "gain_heldout.json").read_text())["results"]["sft_Dense_noisy"]["per_template"]

    class Sized:  # prompt_batches needs only the number of prompts
        def __len__(self) -> int:
            return len(rows)

    draws = {}
    for seed in (0, 1):
        it = prompt_batches(Sized(), 8, seed)
        draws[f"thinpipe seed {seed}"] = [next(it) for _ in range(20)]
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    draws["TRL seed 0"] = [perm[8 * k:8 * k + 8] for k in range(20)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for name, steps in draws.items():
        expect = [mean([acc[rows[i]["template"]] for i in s]) for s in steps]
        two = [mean([rows[i]["template"] in TWO_STEP for i in s]) for s in steps]
        print(f"{name:16s} two-step share, steps 1-5 / 16-20: {mean(two[:5]):.2f} / {mean(two[-5:]):.2f}; the start's "
              f"expected reward on them: {mean(expect[:5]):.3f} / {mean(expect[-5:]):.3f}")


if __name__ == "__main__":
    main()
