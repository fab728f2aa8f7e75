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
    e.add_argument("--batch-size", type=int, default=16, help="multiple-choice: requests per forward")
    e.add_argument("--gen-batch-size", type=int, default=8, help="generative tasks: prompts per generation pass")
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
    if args.gen_batch_size < 1:
        raise ConfigError(f"--gen-batch-size must be >= 1, got {args.gen_batch_size}")
    if args.samples and Path(args.samples).is_dir():
        raise ConfigError(f"--samples {args.samples} is a folder: give the path of the JSON file to write")
    if args.samples:
        check_out_path(Path(args.samples).parent, "--samples")  # written after the evaluation: checked before it
    logits_fn, tokenizer, generate_batch = _eval_model(args.model, args.device)
    from thinpipe.eval import evaluate_mc
    from thinpipe.eval.generative import evaluate_generative

    results = []
    with torch.no_grad():
        for t in tasks:
            if t in GENERATIVE:
                results.append(evaluate_generative(None, tokenizer, t, limit=args.limit,
                                                   max_new_tokens=args.max_new_tokens, timeout_s=args.timeout,
                                                   generate_batch=generate_batch, batch_size=args.gen_batch_size))
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
    generate_batch).

    Generative tasks run on a mesh with a KV cache per stage, batched (``mesh_generator``): a run on its
    restored mesh, through the boundaries that are part of its model (ssn, mapl, mapl-vq, bottleneck),
    dense otherwise; a model as one stage. Multiple-choice scoring reads ``logits_fn``: a run whose
    boundaries are part of the model through them (``SimMesh.logits``), any other as its merged
    Hugging Face model."""
    from thinpipe.config import ARCHITECTURAL_KINDS
    from thinpipe.eval import logits_fn_from_model
    from thinpipe.models import load_model
    from thinpipe.models.presets import DEFAULT_MODEL
    from thinpipe.placement import resolve_device

    path = Path(spec)
    if path.is_dir() and (path / "config.toml").is_file():  # a run folder
        from thinpipe.engine.run_folder import load_mesh
        from thinpipe.models import merge_stages
        from thinpipe.models.lora import merge_lora

        cfg = load_config(path / "config.toml")
        _, mesh, loaded = load_mesh(path, device)
        generate_batch = mesh_generator(loaded.tokenizer, mesh=mesh)
        if cfg.boundary.kind in ARCHITECTURAL_KINDS:
            return mesh.logits, loaded.tokenizer, generate_batch
        model = merge_lora(merge_stages(loaded.model, mesh.replicas[0])).to(mesh.device).eval()  # as load_run
        return logits_fn_from_model(model), loaded.tokenizer, generate_batch
    loaded = load_model(DEFAULT_MODEL if spec == "default" else spec)
    loaded.model.to(resolve_device(device)).eval()
    return logits_fn_from_model(loaded.model), loaded.tokenizer, mesh_generator(loaded.tokenizer, model=loaded.model)


def mesh_generator(tokenizer, mesh=None, model=None):
    """``generate_batch(prompts, stop, max_new_tokens) -> completions`` of ``evaluate_generative``: greedy,
    batched, on replica 0 of ``mesh`` or on ``model`` as one stage; prompts as the one-by-one path cuts them
    (``eval/generative.py: prompt_ids``), completions cut at the first stop string."""
    from thinpipe.comm import ByteMeter, Mailbox
    from thinpipe.engine.sim_generate import generate_on_mesh, generate_on_stages
    from thinpipe.eval.generative import prompt_ids
    from thinpipe.models import build_stages
    from thinpipe.rank.generation import Sampling, truncate_completion

    stages = None if model is None else build_stages(model, None, 1)
    eos = getattr(tokenizer, "eos_token_id", None)

    def generate_batch(prompts: list[str], stop: list[str], max_new_tokens: int) -> list[str]:
        sampling = Sampling(max_new_tokens, temperature=0.0, stop=list(stop), eos_ids=[] if eos is None else [eos])
        ids = [prompt_ids(tokenizer, p, max_new_tokens) for p in prompts]
        if mesh is not None:
            outs = generate_on_mesh(mesh, ids, sampling, tokenizer, batch_size=None)
        else:
            outs = generate_on_stages(stages, [], Mailbox(ByteMeter()), ids, sampling, tokenizer, batch_size=None)
        return [truncate_completion(o, tokenizer, sampling) for o in outs]

    return generate_batch
