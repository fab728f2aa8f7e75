"""``thinpipe eval``: multiple-choice (log-likelihood, lm-eval formats) and generative (GSM8K, HumanEval, MBPP)
evaluation of a model, a preset or a run folder (docs/eval.md). Named ``evaluate`` so as not to shadow the
``thinpipe.eval`` package it runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from thinpipe.commands.common import add_device_arg
from thinpipe.commands.preflight import validate_tasks
from thinpipe.config import ConfigError, load_config
from thinpipe.runlock import check_out_path

NAME = "eval"
HELP = "multiple-choice (lm-eval formats) and generative (gsm8k, humaneval, mbpp) evaluation"


def add_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("--model", default="default", help="default | preset | HF folder | thinpipe run folder")
    e.add_argument("--tasks", required=True,
                   help="comma-separated, e.g. arc_easy,piqa,hellaswag or gsm8k,humaneval,mbpp")
    e.add_argument("--limit", type=int, default=None, help="items per task")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--max-new-tokens", type=int, default=256, help="generative tasks: tokens per completion")
    e.add_argument("--timeout", type=float, default=10.0, help="humaneval / mbpp: seconds per program in the sandbox")
    e.add_argument("--samples", help="write every completion and its verdict to this JSON file")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_device_arg(e)


def run(args) -> int:
    """Multiple-choice (log-likelihood) and generative (GSM8K, HumanEval, MBPP) evaluation."""
    import torch

    from thinpipe.eval.generative import GENERATIVE

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks is empty: give e.g. --tasks arc_easy,piqa or --tasks gsm8k")
    validate_tasks([t for t in tasks if t not in GENERATIVE], extra=sorted(GENERATIVE))
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1 or args.timeout <= 0:
        raise ConfigError(f"--max-new-tokens must be >= 1 and --timeout > 0, got {args.max_new_tokens}, "
                          f"{args.timeout}")
    if args.samples and Path(args.samples).is_dir():
        raise ConfigError(f"--samples {args.samples} is a folder: give the path of the JSON file to write")
    if args.samples:
        check_out_path(Path(args.samples).parent, "--samples")  # written after the evaluation: checked before it
    logits_fn, tokenizer, model = _eval_model(args.model, args.device)
    from thinpipe.eval import evaluate_mc
    from thinpipe.eval.generative import evaluate_generative, logits_generate

    results = []
    with torch.no_grad():
        for t in tasks:
            if t in GENERATIVE:
                results.append(evaluate_generative(model, tokenizer, t, limit=args.limit,
                                                   max_new_tokens=args.max_new_tokens, timeout_s=args.timeout,
                                                   generate=None if model is not None else logits_generate(logits_fn)))
            else:
                results.append(evaluate_mc(logits_fn, tokenizer, t, limit=args.limit, batch_size=args.batch_size))
    if args.samples:
        Path(args.samples).write_text(json.dumps(results, indent=2))
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "samples"} for r in results], indent=2))
    else:
        print(f"{'task':<16}{'n':>6}{'metric':>13}{'value':>9}{'stderr':>9}")
        for r in results:
            if "metric" in r:
                print(f"{r['task']:<16}{r['n']:>6}{r['metric']:>13}{r[r['metric']]:>9.4f}{r['stderr']:>9.4f}")
            else:
                print(f"{r['task']:<16}{r['n']:>6}{'acc':>13}{r['acc']:>9.4f}{r['acc_stderr']:>9.4f}")
                print(f"{'':<16}{'':>6}{'acc_norm':>13}{r['acc_norm']:>9.4f}{r['acc_norm_stderr']:>9.4f}")
    return 0


def _eval_model(spec: str, device: str = "cpu"):
    """``default`` / a preset / a model folder / a thinpipe run folder -> (logits_fn, tokenizer,
    Hugging Face model or None).

    A run whose boundaries are part of the model (ssn, mapl, mapl-vq, bottleneck) is evaluated
    through them on its restored mesh (no HF model: generation then runs without a KV cache); any
    other run as its merged Hugging Face model."""
    from thinpipe.config import ARCHITECTURAL_KINDS
    from thinpipe.eval import logits_fn_from_model
    from thinpipe.models import load_model
    from thinpipe.models.presets import DEFAULT_MODEL
    from thinpipe.placement import resolve_device

    path = Path(spec)
    if path.is_dir() and (path / "config.toml").is_file():  # a run folder
        from thinpipe.engine.run_folder import load_mesh, load_run

        cfg = load_config(path / "config.toml")
        if cfg.boundary.kind in ARCHITECTURAL_KINDS:
            _, mesh, loaded = load_mesh(path, device)
            return mesh.logits, loaded.tokenizer, None
        _, model, tok = load_run(path, device)
        model.eval()
        return logits_fn_from_model(model), tok, model
    loaded = load_model(DEFAULT_MODEL if spec == "default" else spec)
    loaded.model.to(resolve_device(device)).eval()
    return logits_fn_from_model(loaded.model), loaded.tokenizer, loaded.model
