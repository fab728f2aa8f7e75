"""Greedy generation speed on the simulated mesh: the KV-cached, batched pass against the old paths.

Same prompts, same model, same mesh (``mesh.pp`` stages), greedy, every completion exactly
``--new`` tokens (EOS ignored, no stop strings, so every path produces the same number of tokens):

- ``whole-seq``: ``eval/generative.py: logits_generate`` over ``SimMesh.logits``, one prompt at a time,
  the whole sequence re-run per token (what ``thinpipe eval`` did for a run whose boundaries are
  part of the model);
- ``hf-cache``: ``greedy_generate`` on the merged Hugging Face model, one prompt at a time with its
  KV cache (what it did for any other run);
- ``mesh bN``: ``engine/sim_generate.py: generate_on_mesh``, a KV cache per stage, N prompts per pass.

Prompts: the first ``--prompts`` GSM8K 8-shot prompts (the eval's own, cut to their last ``--prompt-len``
tokens) when the benchmark wheel is available, else fixed English text cut alike. Reports generated
tokens/s per path and the speed-up over ``whole-seq``; checks that every path gives the same text.
Writes ``benchmarks/results/generation_speed.json``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/generation_speed.py [--models tiny-llama,smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from thinpipe.config import Config, apply_overrides
from thinpipe.engine.sim_generate import generate_on_mesh
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.eval.generative import greedy_generate, logits_generate
from thinpipe.models import merge_stages
from thinpipe.provenance import code_stamp
from thinpipe.rank.from_config import load
from thinpipe.rank.generation import Sampling, truncate_completion

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "generation_speed.json"
FALLBACK = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May? Let us think step by step. ") * 8


class NoEos:
    """The tokenizer with no EOS id, so that every path generates exactly the tokens asked for."""

    eos_token_id = None

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text, add_special_tokens=False):
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids):
        return self.tok.decode(ids)


def prompt_texts(n: int) -> tuple[list[str], str]:
    try:
        from thinpipe.eval.generative import load_generative

        return [item.prompt for item in load_generative("gsm8k", n)], "gsm8k"
    except Exception:  # noqa: BLE001 - no wheel offline: fixed text
        return [FALLBACK[i * 7:] for i in range(n)], "fixed text"


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def bench_model(name: str, pp: int, n_prompts: int, new: int, prompt_len: int, batches: list[int],
                skip_whole: bool) -> dict:
    cfg = Config()
    apply_overrides(cfg, {"model.name": name, "mesh.pp": pp, "train.dtype": "float32"}, source="generation_speed")
    cfg.validate()
    loaded = load(cfg)
    mesh = SimMesh(loaded.model, cfg)
    tok = NoEos(loaded.tokenizer)
    texts, source = prompt_texts(n_prompts)
    ids = [tok.encode(t)[-prompt_len:] for t in texts]
    texts = [tok.decode(p) for p in ids]          # the prompts every path sees, already cut
    ids = [tok.encode(t) for t in texts]
    sampling = Sampling(max_new_tokens=new, temperature=0)
    total = new * len(ids)
    rows, outputs = [], {}

    def add(path: str, seconds: float, texts_out: list[str]) -> None:
        outputs[path] = texts_out
        rows.append({"path": path, "seconds": seconds, "tokens_per_s": total / seconds})
        print(f"  {name:<14}{path:<12}{seconds:>9.2f} s{total / seconds:>10.1f} tok/s", flush=True)

    warm = Sampling(max_new_tokens=2, temperature=0)
    generate_on_mesh(mesh, ids[:2], warm, tok)  # first calls pay one-time set-up: not timed
    logits_generate(mesh.logits)(None, tok, texts[0], [], 2)
    for b in batches:
        out, dt = timed(lambda b=b: generate_on_mesh(mesh, ids, sampling, tok, batch_size=b))
        add(f"mesh b{b}", dt, [truncate_completion(o, tok, sampling) for o in out])
    model = merge_stages(loaded.model, mesh.replicas[0]).eval()
    greedy_generate(model, tok, texts[0], [], 2)
    out, dt = timed(lambda: [greedy_generate(model, tok, t, [], new) for t in texts])
    add("hf-cache", dt, out)
    if not skip_whole:
        old = logits_generate(mesh.logits)
        out, dt = timed(lambda: [old(None, tok, t, [], new) for t in texts])
        add("whole-seq", dt, out)
    base = next((r["seconds"] for r in rows if r["path"] == "whole-seq"), None)
    for r in rows:
        r["speedup_vs_whole_seq"] = base / r["seconds"] if base else None
    ref = outputs["mesh b1"] if "mesh b1" in outputs else next(iter(outputs.values()))
    return {"model": name, "pp": pp, "batches": batches, "prompts": len(ids), "prompt_source": source,
            "prompt_tokens": [len(p) for p in ids], "new_tokens": new, "threads": torch.get_num_threads(),
            "same_text": {p: o == ref for p, o in outputs.items()}, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-llama,smollm2-135m")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens kept (the end of each prompt)")
    ap.add_argument("--batches", default="1,8", help="prompts per mesh pass, comma-separated")
    ap.add_argument("--skip-whole", default="", help="models to run without the (slow) whole-sequence path")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    results = []
    with torch.no_grad():
        for name in args.models.split(","):
            results.append(code_stamp() | bench_model(name, args.pp, args.prompts, args.new, args.prompt_len, batches,
                                       name in args.skip_whole.split(",")))
    print(f"\n{'model':<14}{'path':<12}{'tok/s':>10}{'x whole-seq':>13}  same text")
    for res in results:
        for r in res["rows"]:
            x = f"{r['speedup_vs_whole_seq']:.1f}" if r["speedup_vs_whole_seq"] else "-"
            print(f"{res['model']:<14}{r['path']:<12}{r['tokens_per_s']:>10.1f}{x:>13}  {res['same_text'][r['path']]}")
    # one entry per model: a later run of some models keeps the others' numbers
    kept = json.loads(RESULTS.read_text())["results"] if RESULTS.is_file() else []
    ran = {r["model"] for r in results}
    results = [r for r in kept if r["model"] not in ran] + results
    RESULTS.write_text(json.dumps({"results": results}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
