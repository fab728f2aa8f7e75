"""Arithmetic word problems for the RL-after-SFT experiment (anchor-priors App. D / Table 9).

The paper asks whether a communication-compressed SFT leaves the model amenable to RL with
verifiable rewards (GSPO). At 135M parameters GSM8K is out of reach, so the task here is one- and
two-step word problems with small integers (adding, taking away, small products, "how many left /
in total"), varied in template, names and objects, each with one integer answer a reward can check.

Three files, disjoint by problem text and by (template, numbers) -- the same numbers in the same
template never appear in two files, whatever the names and objects:

    data/sft.jsonl       {"prompt", "completion"}  worked solution ending "The answer is N."
    data/rl_train.jsonl  {"prompt", "answer"}      the GSPO prompts
    data/heldout.jsonl   {"prompt", "answer"}      never trained on (greedy accuracy)
    data/dpo_train.jsonl {"prompt", "chosen", "rejected"}  SFT-split problems: the right solution vs a slip in
                                                           its last step (a wrong final number)
    data/dpo_heldout.jsonl  the same for the held-out problems (held-out preference accuracy)
    data/sft_noisy.jsonl the SFT problems, a flawed demonstrator's: ``--noisy-fraction`` of the two-step problems'
                         solutions stop after the first step and state its result as the answer (issue 40: a
                         start whose errors share one cause, which a verifiable reward can see)

The prompt asks for the closing "The answer is N." so that ``thinpipe.eval.generative.gsm8k_extract``
(the number after "The answer is", else the last number) reads the answer. Deterministic from
``--seed``:

    .venv/bin/python experiments/rl/make_data.py --out experiments/rl/data
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

INSTRUCTION = 'Solve the problem step by step, then end your reply with "The answer is <number>."'

NAMES = [("Mia", "she"), ("Liam", "he"), ("Emma", "she"), ("Noah", "he"), ("Olivia", "she"), ("Lucas", "he"),
         ("Ava", "she"), ("Ethan", "he"), ("Sofia", "she"), ("Leo", "he"), ("Zoe", "she"), ("Omar", "he"),
         ("Hana", "she"), ("Ravi", "he"), ("Nora", "she"), ("Tom", "he"), ("Lily", "she"), ("Sam", "he"),
         ("Aisha", "she"), ("Ben", "he"), ("Chloe", "she"), ("Diego", "he"), ("Grace", "she"), ("Max", "he")]
OBJECTS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells", "cards",
           "balloons", "oranges", "toy cars", "crayons", "buttons", "coins", "cupcakes", "flowers", "eggs"]
CONTAINERS = ["boxes", "bags", "jars", "baskets", "packs", "trays"]


def _pick(rng: random.Random, k: int) -> list[tuple[str, str]]:
    return rng.sample(NAMES, k)


# Each template: (id, numbers drawn from rng, render(numbers, rng) -> (problem, solution, answer)).
# Numbers stay small so that a 135M model can do the arithmetic some of the time.

def _add(rng):
    return rng.randint(3, 40), rng.randint(2, 30)


def _add_text(n, rng):
    a, b = n
    (p, s), obj = _pick(rng, 1)[0], rng.choice(OBJECTS)
    q = f"{p} has {a} {obj}. Then {s} gets {b} more {obj}. How many {obj} does {p} have now?"
    return q, f"{p} starts with {a} {obj} and gets {b} more, so {a} + {b} = {a + b}.", a + b


def _total(n, rng):
    a, b = n
    (p, _), (r, _) = _pick(rng, 2)
    obj = rng.choice(OBJECTS)
    q = f"{p} has {a} {obj} and {r} has {b} {obj}. How many {obj} do they have in total?"
    return q, f"Together they have {a} + {b} = {a + b} {obj}.", a + b


def _sub(rng):
    a = rng.randint(8, 50)
    return a, rng.randint(2, a - 1)


def _sub_text(n, rng):
    a, b = n
    (p, s), (r, _) = _pick(rng, 2)
    obj = rng.choice(OBJECTS)
    q = f"{p} had {a} {obj}. {s.capitalize()} gave {b} of them to {r}. How many {obj} does {p} have left?"
    return q, f"{p} had {a} {obj} and gave away {b}, so {a} - {b} = {a - b}.", a - b


def _eat_text(n, rng):
    a, b = n
    p, _ = _pick(rng, 1)[0]
    food = rng.choice(["cookies", "grapes", "crackers", "candies", "strawberries", "nuts"])
    q = f"There were {a} {food} on a plate. {p} ate {b} of them. How many {food} are left on the plate?"
    return q, f"There were {a} {food} and {b} were eaten, so {a} - {b} = {a - b}.", a - b


def _mul(rng):
    return rng.randint(2, 9), rng.randint(2, 20)


def _mul_text(n, rng):
    a, b = n
    box, obj = rng.choice(CONTAINERS), rng.choice(OBJECTS)
    q = f"There are {a} {box} with {b} {obj} in each. How many {obj} are there in total?"
    return q, f"There are {a} {box} with {b} {obj} each, so {a} x {b} = {a * b}.", a * b


def _price_text(n, rng):
    a, b = n  # b: price per item
    p, _ = _pick(rng, 1)[0]
    item = rng.choice(["notebooks", "pens", "tickets", "toys", "mugs", "kites"])
    q = f"Each of the {item} costs {b} dollars. {p} buys {a} {item}. How many dollars does {p} spend?"
    return q, f"{p} buys {a} {item} at {b} dollars each, so {a} x {b} = {a * b} dollars.", a * b


def _add_sub(rng):
    a, b = rng.randint(5, 30), rng.randint(2, 20)
    return a, b, rng.randint(2, a + b - 1)


def _add_sub_text(n, rng):
    a, b, c = n
    (p, s), (r, _) = _pick(rng, 2)
    obj = rng.choice(OBJECTS)
    q = (f"{p} has {a} {obj}. {s.capitalize()} buys {b} more, then gives {c} to {r}. "
         f"How many {obj} does {p} have now?")
    sol = f"First {a} + {b} = {a + b}. Then {a + b} - {c} = {a + b - c}."
    return q, sol, a + b - c


def _sub_sub(rng):
    a = rng.randint(12, 50)
    b = rng.randint(2, a // 2)
    return a, b, rng.randint(1, a - b - 1)


def _sub_sub_text(n, rng):
    a, b, c = n
    (p, s), (r, _), (t, _) = _pick(rng, 3)
    obj = rng.choice(OBJECTS)
    q = f"{p} had {a} {obj}. {s.capitalize()} gave {b} to {r} and {c} to {t}. How many {obj} are left?"
    return q, f"First {a} - {b} = {a - b}. Then {a - b} - {c} = {a - b - c}.", a - b - c


def _mul_add(rng):
    return rng.randint(2, 6), rng.randint(2, 9), rng.randint(1, 15)


def _mul_add_text(n, rng):
    a, b, c = n
    (p, s) = _pick(rng, 1)[0]
    box, obj = rng.choice(CONTAINERS), rng.choice(OBJECTS)
    q = (f"{p} buys {a} {box} of {obj} with {b} {obj} in each. {s.capitalize()} already had {c} {obj}. "
         f"How many {obj} does {p} have in total?")
    return q, f"First {a} x {b} = {a * b}. Then {a * b} + {c} = {a * b + c}.", a * b + c


def _mul_sub(rng):
    a, b = rng.randint(2, 6), rng.randint(2, 9)
    return a, b, rng.randint(1, a * b - 1)


def _mul_sub_text(n, rng):
    a, b, c = n
    (p, s) = _pick(rng, 1)[0]
    box, obj = rng.choice(CONTAINERS), rng.choice(["cookies", "muffins", "candies", "crackers"])
    q = (f"{p} has {a} {box} with {b} {obj} in each. {s.capitalize()} eats {c} of the {obj}. "
         f"How many {obj} are left?")
    return q, f"First {a} x {b} = {a * b}. Then {a * b} - {c} = {a * b - c}.", a * b - c


def _three(rng):
    return rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 20)


def _three_text(n, rng):
    a, b, c = n
    (p, _), (r, _), (t, _) = _pick(rng, 3)
    obj = rng.choice(OBJECTS)
    q = f"{p} has {a} {obj}, {r} has {b} {obj} and {t} has {c} {obj}. How many {obj} do they have altogether?"
    return q, f"First {a} + {b} = {a + b}. Then {a + b} + {c} = {a + b + c}.", a + b + c


TEMPLATES = {  # id -> (draw numbers, render)
    "add": (_add, _add_text), "total": (_add, _total), "sub": (_sub, _sub_text), "eat": (_sub, _eat_text),
    "mul": (_mul, _mul_text), "price": (_mul, _price_text), "add_sub": (_add_sub, _add_sub_text),
    "sub_sub": (_sub_sub, _sub_sub_text), "mul_add": (_mul_add, _mul_add_text),
    "mul_sub": (_mul_sub, _mul_sub_text), "three": (_three, _three_text),
}


def prompt_of(problem: str) -> str:
    return f"{problem}\n{INSTRUCTION}"


def make_problems(n: int, seed: int) -> list[dict]:
    """``n`` problems, each a distinct (template, numbers) key and a distinct text; templates drawn
    uniformly (a template whose number space is used up, like the one-step products, just stops
    being drawn)."""
    rng = random.Random(seed)
    keys, texts, out = set(), set(), []
    ids = sorted(TEMPLATES)
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n:
            raise SystemExit(f"could not draw {n} distinct problems; the number ranges are too small")
        tid = rng.choice(ids)
        draw, render = TEMPLATES[tid]
        nums = draw(rng)
        if (tid, nums) in keys:
            continue
        problem, solution, answer = render(nums, rng)
        if problem in texts:
            continue
        keys.add((tid, nums))
        texts.add(problem)
        out.append({"template": tid, "numbers": list(nums), "problem": problem, "solution": solution,
                    "answer": answer})
    return out


def slipped(problem: dict, rng: random.Random) -> tuple[str, int]:
    """The problem's worked solution with an arithmetic slip in its last step (the final result off by 1-3 or 10,
    never negative), and the wrong answer it then states: the rejected side of a DPO pair."""
    sol, right = problem["solution"], problem["answer"]
    while True:
        wrong = right + rng.choice([-10, -3, -2, -1, 1, 2, 3, 10])
        if wrong >= 0:
            break
    cut = sol.rindex(f"= {right}")  # the last step's result
    return sol[:cut] + f"= {wrong}" + sol[cut + len(f"= {right}"):], wrong


def dpo_pairs(problems: list[dict], seed: int) -> list[dict]:
    """TRL's preference format: the prompt, the right worked solution (chosen) and the same one with a slip."""
    rng = random.Random(seed)
    out = []
    for p in problems:
        bad, wrong = slipped(p, rng)
        out.append({"prompt": prompt_of(p["problem"]), "chosen": f"{p['solution']} The answer is {p['answer']}.",
                    "rejected": f"{bad} The answer is {wrong}.", "template": p["template"]})
    return out


def stopped_early(problem: dict) -> tuple[str, int] | None:
    """A two-step problem's solution cut after its first step, that step's result stated as the answer (the flaw
    of ``sft_noisy.jsonl``); None for a one-step problem or when the first result happens to be the answer."""
    sol = problem["solution"]
    if not sol.startswith("First ") or ". Then " not in sol:
        return None
    first = sol.split(". Then ")[0] + "."
    mid = int(first.rsplit("= ", 1)[1].rstrip("."))
    return None if mid == problem["answer"] else (first, mid)


def noisy_sft(problems: list[dict], fraction: float, seed: int) -> list[dict]:
    """The SFT rows with ``fraction`` of the two-step solutions stopped early (``stopped_early``)."""
    rng = random.Random(seed)
    out = []
    for p in problems:
        cut = stopped_early(p)
        sol, ans = cut if cut is not None and rng.random() < fraction else (p["solution"], p["answer"])
        out.append({"prompt": prompt_of(p["problem"]), "completion": f"{sol} The answer is {ans}.",
                    "flawed": sol != p["solution"]})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "data"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft", type=int, default=2000)
    ap.add_argument("--rl", type=int, default=1000)
    ap.add_argument("--heldout", type=int, default=300)
    ap.add_argument("--dpo", type=int, default=200, help="training preference pairs (from the SFT split's last rows)")
    ap.add_argument("--noisy-fraction", type=float, default=0.5,
                    help="of the two-step SFT solutions, the share sft_noisy.jsonl stops after the first step")
    args = ap.parse_args()
    probs = make_problems(args.heldout + args.rl + args.sft, args.seed)
    random.Random(args.seed + 1).shuffle(probs)  # splits drawn from one pool: disjoint by construction
    held, rl, sft = (probs[:args.heldout], probs[args.heldout:args.heldout + args.rl],
                     probs[args.heldout + args.rl:])
    out = Path(args.out)
    write_jsonl(out / "heldout.jsonl", [{"prompt": prompt_of(p["problem"]), "answer": str(p["answer"]),
                                         "template": p["template"]} for p in held])
    write_jsonl(out / "rl_train.jsonl", [{"prompt": prompt_of(p["problem"]), "answer": str(p["answer"]),
                                          "template": p["template"]} for p in rl])
    write_jsonl(out / "sft.jsonl", [{"prompt": prompt_of(p["problem"]),
                                     "completion": f"{p['solution']} The answer is {p['answer']}."} for p in sft])
    noisy = noisy_sft(sft, args.noisy_fraction, args.seed + 4)
    write_jsonl(out / "sft_noisy.jsonl", noisy)
    # DPO (the chain SFT -> DPO -> GSPO): pairs on SFT-split problems to train, on the held-out problems to measure
    write_jsonl(out / "dpo_train.jsonl", dpo_pairs(sft[-args.dpo:], args.seed + 2))
    write_jsonl(out / "dpo_heldout.jsonl", dpo_pairs(held, args.seed + 3))
    print(f"wrote {len(held)} heldout, {len(rl)} rl_train, {len(sft)} sft rows ({sum(r['flawed'] for r in noisy)} "
          f"stopped early in sft_noisy), {args.dpo} + {len(held)} DPO pairs to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
