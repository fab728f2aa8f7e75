"""``thinpipe eval``: multiple-choice (log-likelihood, lm-eval formats) and generative (GSM8K, HumanEval, MBPP)
evaluation of a model, a preset or a run folder, and the perplexity of a user's own text through the mesh's
held-out pass (docs/eval.md). Named ``evaluate`` so as not to shadow the ``thinpipe.eval`` package it runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from thinpipe.commands.common import add_device_arg
from thinpipe.commands.preflight import validate_tasks
from thinpipe.config import ConfigError
from thinpipe.runlock import check_out_path

NAME = "eval"
HELP = "multiple-choice (lm-eval formats), generative (gsm8k, humaneval, mbpp) and perplexity evaluation"


def add_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("--model", default="default", help="default | preset | HF folder | thinpipe run folder")
    e.add_argument("--tasks", help="comma-separated, e.g. arc_easy,piqa,hellaswag or gsm8k,humaneval,mbpp "
                                   "(optional with --perplexity)")
    e.add_argument("--perplexity", metavar="FILE",
                   help="JSONL of {\"text\": ...} rows: each row's summed next-token NLL through the mesh's "
                        "held-out pass (its stages; a run's boundaries)")
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override as in train, e.g. mesh.pp=2 splits --model over 2 stages")
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

    if args.tasks is None and not args.perplexity:
        raise ConfigError("give --tasks (e.g. --tasks arc_easy,piqa or --tasks gsm8k) or --perplexity FILE")
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    if not tasks and not args.perplexity:
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
    texts = None
    if args.perplexity:
        from thinpipe.eval.perplexity import read_texts

        texts = read_texts(args.perplexity)  # a bad file is one line before any model loads
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    logits_fn, tokenizer, generate_batch, mesh = _eval_model(args.model, args.device, args.set,
                                                              need_mesh=texts is not None)
    from thinpipe.eval import evaluate_mc
    from thinpipe.eval.generative import evaluate_generative

    results = []
    if texts is not None:
        results.append(_perplexity(mesh, tokenizer, texts, args))
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
        records = [{k: v for k, v in r.items() if k != "samples"} for r in results]
        # --perplexity alone: one object with its keys at the top; with tasks: the list, perplexity first
        print(json.dumps(records[0] if texts is not None and not tasks else records, indent=2))
    else:
        print(f"{'task':<16}{'n':>6}{'metric':>13}{'value':>9}{'stderr':>9}")
        for r in results:
            if r["task"] == "perplexity":
                print(f"{'perplexity':<16}{r['rows']:>6}{'ppl':>13}{_num(r['perplexity']):>9}{'':>9}")
                print(f"{'':<16}{'':>6}{'nll/token':>13}{_num(r['nll_per_token']):>9}{'':>9}")
                print(f"{'':<16}{'':>6}{'tokens':>13}{r['tokens']:>9}{'':>9}")
                print(f"{'':<16}{'':>6}{'stages':>13}{r['pp']:>9}{'':>9}")
            elif "metric" in r:
                print(f"{r['task']:<16}{r['n']:>6}{r['metric']:>13}{r[r['metric']]:>9.4f}{r['stderr']:>9.4f}")
            else:
                print(f"{r['task']:<16}{r['n']:>6}{'acc':>13}{r['acc']:>9.4f}{r['acc_stderr']:>9.4f}")
                print(f"{'':<16}{'':>6}{'acc_norm':>13}{r['acc_norm']:>9.4f}{r['acc_norm_stderr']:>9.4f}")
    return 0


def _num(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _perplexity(mesh, tokenizer, texts: list[str], args) -> dict:
    """The perplexity record of ``texts`` through ``mesh``'s held-out pass (replica 0), with a progress bar."""
    import sys

    from tqdm import tqdm

    from thinpipe.eval.perplexity import perplexity

    with tqdm(total=len(texts), desc="perplexity", unit="row", file=sys.stderr, leave=False) as bar:
        out = perplexity(mesh.eval_loss, tokenizer, texts, batch_size=args.batch_size, progress=bar.update)
    return {"task": "perplexity", "file": str(args.perplexity), **out, "pp": mesh.cfg.mesh.pp}


def _eval_model(spec: str, device: str = "cpu", sets: list[str] = (), need_mesh: bool = False):
    """``default`` / a preset / a model folder / a thinpipe run folder -> (logits_fn, tokenizer,
    generate_batch, mesh or None).

    A run folder, or a model with ``sets`` (``--set mesh.pp=2`` splits it) or ``need_mesh`` (perplexity),
    is a simulated mesh: generative tasks run on its stages with a KV cache per stage, batched
    (``mesh_generator``), perplexity through its held-out pass, multiple choice through its logits
    (``SimMesh.logits``: through a run's boundaries where they are part of its model, dense otherwise),
    except a run whose boundaries are not part of its model, scored as its merged Hugging Face model.
    A model alone is its Hugging Face model for multiple choice and one stage for generation."""
    from thinpipe.commands.mesh_source import build_mesh, is_run_folder
    from thinpipe.eval import logits_fn_from_model
    from thinpipe.models import load_model
    from thinpipe.models.presets import DEFAULT_MODEL
    from thinpipe.placement import resolve_device

    run = is_run_folder(spec)
    model_name = None if spec == "default" else spec
    if run or sets or need_mesh:
        mesh, loaded = build_mesh(spec if run else None, None if run else model_name, list(sets), device)
        tokenizer = loaded.tokenizer
        generate_batch = mesh_generator(tokenizer, mesh=mesh)
        if run and not any(b.architectural for b in mesh.boundaries):  # the kind says whether it is the model
            from thinpipe.models import merge_stages
            from thinpipe.models.lora import merge_lora

            model = merge_lora(merge_stages(loaded.model, mesh.replicas[0])).to(mesh.device).eval()  # as load_run
            return logits_fn_from_model(model), tokenizer, generate_batch, mesh
        return mesh.logits, tokenizer, generate_batch, mesh
    loaded = load_model(DEFAULT_MODEL if model_name is None else model_name)
    loaded.model.to(resolve_device(device)).eval()
    return logits_fn_from_model(loaded.model), loaded.tokenizer, mesh_generator(loaded.tokenizer, model=loaded.model), \
        None


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
