"""Held-out accuracy of the base model and of each SFT arm on ``data/heldout.jsonl`` (anchor-priors
App. D / Table 9 asks whether RL still has room after a compressed SFT).

Independent of thinpipe's training path on purpose: a run folder's replicas are merged into one
Hugging Face model (``thinpipe.engine.run_folder.load_run``: the boundaries are a training-time
wire, not part of the model) and HF ``model.generate`` decodes, batched with left padding. The
prompt is rendered exactly as SFT tokenized it (``thinpipe.data.chat.prompt_text``: ChatML, no
system turn); generation stops at ``<|im_end|>``. Scoring: ``gsm8k_extract`` (the number after
"The answer is", else the last number) equal to the answer after ``normalize_number``.

Greedy accuracy p over n items is reported with stderr sqrt(p(1-p)/(n-1)). With ``--samples K`` the
first ``--sample-prompts`` items are also drawn K times at temperature 1.0, to see that a GSPO group
would have reward spread (samples that differ, some correct, some not).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/eval_heldout.py \\
        --model base --model /work/rl_runs/sft_Dense ... --out experiments/rl/results/sft_baseline.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from thinpipe.data.chat import prompt_text
from thinpipe.eval.generative import gsm8k_extract, normalize_number
from thinpipe.provenance import code_stamp

HERE = Path(__file__).resolve().parent


def stderr(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")


def correct(completion: str, answer: str) -> bool:
    got = gsm8k_extract(completion)
    return got is not None and got == normalize_number(answer)


def load(which: str):
    """(model, tokenizer) of ``base`` (SmolLM2-135M-Instruct) or of a thinpipe run folder."""
    if which == "base":
        from thinpipe.models.loading import load_model

        m = load_model("smollm2-135m")
        return m.model, m.tokenizer
    from thinpipe.engine.run_folder import load_run

    _, model, tok = load_run(which)
    return model, tok


@torch.no_grad()
def generate(model, tok, prompts: list[str], max_new_tokens: int, batch: int, sample: bool = False,
             seed: int = 0) -> list[str]:
    """Completions of ``prompts`` (ChatML user turns), left-padded batches, cut at <|im_end|>."""
    model.eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.pad_token_id if tok.pad_token_id is not None else end
    out: list[str] = []
    gen = torch.Generator().manual_seed(seed)
    for i in range(0, len(prompts), batch):
        enc = [tok.encode(prompt_text(p), add_special_tokens=False) for p in prompts[i:i + batch]]
        width = max(map(len, enc))
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
        att = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        if sample:  # generate() draws from torch's global generator: seed it per batch, reproducibly
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        res = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens, eos_token_id=end,
                             pad_token_id=pad, **kw)
        out += [tok.decode(r[width:], skip_special_tokens=True) for r in res]
    return out


def evaluate(which: str, rows: list[dict], args) -> dict:
    t0 = time.perf_counter()
    model, tok = load(which)
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    comps = generate(model, tok, prompts, args.max_new_tokens, args.batch)
    ok = [correct(c, a) for c, a in zip(comps, answers)]
    n, p = len(ok), sum(ok) / len(ok)
    per_template: dict[str, list[int]] = {}
    for r, k in zip(rows, ok):
        per_template.setdefault(r.get("template", "?"), []).append(int(k))
    res = {"model": which, "n": n, "greedy_acc": p, "greedy_stderr": stderr(p, n),
           "format_rate": sum("The answer is" in c for c in comps) / n,
           "per_template": {t: round(sum(v) / len(v), 3) for t, v in sorted(per_template.items())},
           "correct": "".join(str(int(k)) for k in ok),  # item by item, for paired comparisons of two models
           "examples": [{"prompt": r["prompt"].split("\n")[0], "answer": a, "completion": c, "correct": k}
                        for r, a, c, k in list(zip(rows, answers, comps, ok))[:5]]}
    if args.samples:
        sp, sa = prompts[:args.sample_prompts], answers[:args.sample_prompts]
        rep = [p for p in sp for _ in range(args.samples)]
        sc = generate(model, tok, rep, args.max_new_tokens, args.batch, sample=True, seed=args.seed)
        groups = []
        for j, a in enumerate(sa):
            g = sc[j * args.samples:(j + 1) * args.samples]
            groups.append({"answer": a, "correct": [correct(c, a) for c in g], "distinct": len(set(g)),
                           "extracted": [gsm8k_extract(c) for c in g]})
        flat = [k for g in groups for k in g["correct"]]
        res["sampling"] = {"temperature": 1.0, "k": args.samples, "prompts": len(groups),
                           "acc": sum(flat) / len(flat),
                           "groups_with_spread": sum(0 < sum(g["correct"]) < len(g["correct"]) for g in groups),
                           "groups_all_distinct": sum(g["distinct"] == args.samples for g in groups),
                           "groups": groups, "example": sc[0]}
    res["eval_s"] = time.perf_counter() - t0
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True, help="'base' or a run folder; repeatable")
    ap.add_argument("--data", default=str(HERE / "data" / "heldout.jsonl"))
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--sample-prompts", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results" / "sft_baseline.json"))
    args = ap.parse_args()
    rows = [json.loads(x) for x in Path(args.data).read_text().splitlines() if x.strip()]
    rows = rows[:args.limit] if args.limit else rows
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.is_file() else {}
    results = saved.get("results", {})
    for which in args.model:
        r = evaluate(which, rows, args)
        key = "base" if which == "base" else Path(which).name
        results[key] = {**r, **code_stamp()}
        s = r.get("sampling", {})
        print(f"{key}: greedy {r['greedy_acc']:.3f} +- {r['greedy_stderr']:.3f} (n={r['n']}), format "
              f"{r['format_rate']:.2f}, sampled acc {s.get('acc', float('nan')):.2f}, groups with spread "
              f"{s.get('groups_with_spread', '-')}/{s.get('prompts', '-')}, {r['eval_s']:.0f} s", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"data": args.data, "max_new_tokens": args.max_new_tokens, "results": results},
                                  indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
