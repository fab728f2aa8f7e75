"""lm-eval through the mesh against lm-eval's own `hf` backend on the real default model (issue 39).

SmolLM2-135M-Instruct (its cached Hugging Face folder), the built-in offline tasks, the first ``--limit`` items:
once through lm-eval's ``hf`` backend on the unsplit model, once through ``MeshLM`` on the model split over
``--pp`` stages (what ``thinpipe eval --harness --set mesh.pp=N`` runs). Prints each metric both ways and, per
request, the largest log-likelihood difference and the share of equal generations; saves JSON.

    .venv/bin/python benchmarks/harness_equivalence.py --limit 100 --pp 4 \
        --results benchmarks/results/harness_equivalence_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from thinpipe.provenance import code_stamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEEDS = dict(random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="thinpipe_medmcqa,thinpipe_xsum,thinpipe_narrativeqa")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--results", default="benchmarks/results/harness_equivalence_smollm2.json")
    args = ap.parse_args()
    from lm_eval import simple_evaluate

    from thinpipe.commands.evaluate import _eval_model
    from thinpipe.eval.harness import MeshLM, finite
    from thinpipe.eval.harness_tasks import harness_tasks, task_manager
    from thinpipe.models import load_model
    from thinpipe.models.presets import DEFAULT_MODEL

    tasks, paths = harness_tasks(args.tasks, None)
    folder = Path(load_model(DEFAULT_MODEL).model.name_or_path)
    kw = dict(tasks=tasks, task_manager=task_manager(tuple(paths)), limit=args.limit, log_samples=True, **SEEDS)
    t0 = time.time()
    hf = simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32", device="cpu", batch_size=8,
                         **kw)
    t_hf = time.time() - t0
    logits_fn, tok, gen, _, config = _eval_model(DEFAULT_MODEL, "cpu", [f"mesh.pp={args.pp}"], need_mesh=True)
    t0 = time.time()
    mesh = simple_evaluate(model=MeshLM(logits_fn, tok, gen.ids, config, batch_size=8), **kw)
    t_mesh = time.time() - t0
    rows = []
    for task in tasks:
        a, b = hf["results"][task], mesh["results"][task]
        ra = [s["resps"] for s in hf["samples"][task]]
        rb = [s["resps"] for s in mesh["samples"][task]]
        flat_a, flat_b = [r[0] for x in ra for r in x], [r[0] for x in rb for r in x]
        if isinstance(flat_a[0], (list, tuple)):  # log-likelihood: (logprob, greedy)
            diff = max(abs(float(x[0]) - float(y[0])) for x, y in zip(flat_a, flat_b))
            same = None
        else:
            diff, same = None, sum(x == y for x, y in zip(flat_a, flat_b)) / len(flat_a)
        metrics = {k: {"hf": a[k], "mesh": b[k]} for k in a if "," in k and "_stderr" not in k}
        rows.append({"task": task, "n": len(ra), "metrics": metrics, "max_abs_logprob_diff": diff,
                     "equal_generations": same})
        for k, v in metrics.items():
            print(f"{task:<22}{k:>16}  hf {v['hf']:.4f}  mesh(pp={args.pp}) {v['mesh']:.4f}")
        print(f"{'':<22}{'per request':>16}  " + (f"max |d logp| {diff:.2e}" if diff is not None
                                                    else f"equal generations {same:.0%}"))
    print(f"wall: hf {t_hf:.0f} s, mesh {t_mesh:.0f} s")
    out = {"model": DEFAULT_MODEL, "limit": args.limit, "pp": args.pp, "rows": rows, "wall_s": {"hf": t_hf,
           "mesh": t_mesh}, "command": " ".join(sys.argv), **code_stamp()}
    Path(args.results).write_text(json.dumps(finite(out), indent=2, default=float))
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
