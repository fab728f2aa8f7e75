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
HELP = "multiple-choice, generative (gsm8k, humaneval, mbpp), perplexity, and any lm-eval task (--harness)"


def add_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("--model", default="default", help="default | preset | HF folder | thinpipe run folder")
    e.add_argument("--run", help="a thinpipe run folder (the same as --model RUN): its stages and boundaries")
    e.add_argument("--tasks", help="comma-separated, e.g. arc_easy,piqa,hellaswag or gsm8k,humaneval,mbpp "
                                   "(optional with --harness or --perplexity)")
    e.add_argument("--harness", metavar="TASKS",
                   help="lm-evaluation-harness tasks through the mesh, comma-separated: any task lm-eval lists, "
                        "thinpipe_medmcqa, thinpipe_xsum, thinpipe_narrativeqa (offline), or yours (--harness-include)")
    e.add_argument("--harness-include", metavar="DIR", help="a folder of lm-eval task YAMLs (lm-eval's include_path)")
    e.add_argument("--num-fewshot", type=int, default=None, help="--harness: few-shot examples (default: the task's)")
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

    if args.run:
        if args.model != "default":
            raise ConfigError("give --model or --run, not both: a run folder holds its own model")
        from thinpipe.commands.preflight import check_run

        check_run(Path(args.run))
        args.model = args.run
    if args.harness_include is not None and args.harness is None:
        raise ConfigError("--harness-include names task YAMLs for --harness: give --harness TASKS too")
    if args.tasks is None and not args.perplexity and args.harness is None:
        raise ConfigError("give --tasks (e.g. --tasks arc_easy,piqa or --tasks gsm8k), --harness TASKS or "
                          "--perplexity FILE")
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    if not tasks and not args.perplexity and args.harness is None:
        raise ConfigError("--tasks is empty: give e.g. --tasks arc_easy,piqa or --tasks gsm8k")
    if args.num_fewshot is not None and (args.harness is None or args.num_fewshot < 0):
        raise ConfigError("--num-fewshot N (N >= 0) applies to --harness tasks")
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
    harness = None
    if args.harness is not None:
        from thinpipe.eval.harness import MeshLM  # lm-eval: imported only for --harness
        from thinpipe.eval.harness_tasks import harness_tasks

        harness = harness_tasks(args.harness, args.harness_include)  # unknown tasks: one line, before any model
    # the harness runs on thinpipe's stages: a model alone becomes a one-stage mesh
    logits_fn, tokenizer, generate_batch, mesh, model_config = _eval_model(
        args.model, args.device, args.set, need_mesh=texts is not None or harness is not None)
    from thinpipe.eval.generative import evaluate_generative
    from thinpipe.eval.multiple_choice import evaluate_mc

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
    if harness is not None:
        lm = MeshLM(logits_fn, tokenizer, generate_batch.ids, model_config, batch_size=args.batch_size,
                    gen_batch_size=args.gen_batch_size)
        return _print_harness(_run_harness(harness, lm, mesh, args), results, args)
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


def _run_harness(harness: tuple[list[str], list[str]], lm, mesh, args) -> dict:
    """lm-eval's ``simple_evaluate`` of the tasks on ``lm``, a ``MeshLM`` (``eval/harness.py``): logits through
    the mesh's stages (a run's boundaries where they are part of its model), greedy generation on its KV-cached
    stages."""
    from lm_eval import simple_evaluate

    from thinpipe.eval.harness import finite
    from thinpipe.eval.harness_tasks import task_manager

    tasks, paths = harness
    try:
        out = simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager(tuple(paths)), limit=args.limit,
                              num_fewshot=args.num_fewshot, log_samples=False, random_seed=0, numpy_random_seed=0,
                              torch_random_seed=0, fewshot_random_seed=0)
    except (ConnectionError, FileNotFoundError) as e:  # a task's rows: on the hub (no network) or not on disk
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"--harness: a task's data could not be loaded ({why}): on a machine without the hub, give "
                          "a task YAML whose dataset is local files (dataset_path: json, data_files with absolute "
                          "paths) through --harness-include, or a built-in thinpipe_* task") from None
    return finite({"results": out["results"], "n-samples": out.get("n-samples", {}),
                   "versions": out.get("versions", {}), "model": args.model, "pp": mesh.cfg.mesh.pp})


def _print_harness(out: dict, records: list[dict], args) -> int:
    if records:  # --tasks / --perplexity beside --harness: their records in the same object
        out["thinpipe"] = [{k: v for k, v in r.items() if k != "samples"} for r in records]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'task':<28}{'metric (lm-eval name)':>26}{'value':>12}{'stderr':>10}")
    for task, metrics in out["results"].items():
        for key, value in metrics.items():  # "acc,none": a metric and its filter; "name", "sample_len": not
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name, _, filt = key.partition(",")
            stderr = metrics.get(f"{name}_stderr,{filt}")
            shown = f"{stderr:.4f}" if isinstance(stderr, float) else ""
            print(f"{task:<28}{key:>26}{value:>12.6g}{shown:>10}")
    for r in records:
        print(f"{r['task']}: {json.dumps({k: v for k, v in r.items() if k not in ('task', 'samples')})}")
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
    generate_batch, mesh or None, the model's Hugging Face config).

    A run folder, or a model with ``sets`` (``--set mesh.pp=2`` splits it) or ``need_mesh`` (perplexity),
    is a simulated mesh: generative tasks run on its stages with a KV cache per stage, batched
    (``mesh_generator``), perplexity through its held-out pass, multiple choice through its logits
    (``SimMesh.logits``: through a run's boundaries where they are part of its model, dense otherwise),
    except a run whose boundaries are not part of its model, scored as its merged Hugging Face model.
    A model alone is its Hugging Face model for multiple choice and one stage for generation."""
    from thinpipe.commands.mesh_source import build_mesh, is_run_folder
    from thinpipe.eval.loglik import logits_fn_from_model
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
            return logits_fn_from_model(model), tokenizer, generate_batch, mesh, loaded.model.config
        return mesh.logits, tokenizer, generate_batch, mesh, loaded.model.config
    loaded = load_model(DEFAULT_MODEL if model_name is None else model_name)
    loaded.model.to(resolve_device(device)).eval()
    return logits_fn_from_model(loaded.model), loaded.tokenizer, mesh_generator(loaded.tokenizer, model=loaded.model), \
        None, loaded.model.config


class MeshGenerator:
    """Greedy, batched generation on replica 0 of ``mesh`` or on ``model`` as one stage. Called with prompts
    (``evaluate_generative``'s ``generate_batch(prompts, stop, max_new_tokens) -> completions``): prompts as the
    one-by-one path cuts them (``eval/generative.py: prompt_ids``), completions cut at the first stop string.
    ``ids``: token ids in, the generated ids out (an EOS dropped), for the harness (``eval/harness.py``)."""

    def __init__(self, tokenizer, mesh=None, model=None):
        from thinpipe.models import build_stages

        self.tokenizer, self.mesh = tokenizer, mesh
        self.stages = None if model is None else build_stages(model, None, 1)
        self.eos = getattr(tokenizer, "eos_token_id", None)

    def _sampling(self, stop: list[str], max_new_tokens: int):
        from thinpipe.rank.generation import Sampling

        eos_ids = [] if self.eos is None else [self.eos]
        return Sampling(max_new_tokens, temperature=0.0, stop=list(stop), eos_ids=eos_ids)

    def _generate(self, ids: list[list[int]], sampling) -> list[list[int]]:
        from thinpipe.comm.inprocess import Mailbox
        from thinpipe.comm.meter import ByteMeter
        from thinpipe.engine.sim_generate import generate_on_mesh, generate_on_stages

        if self.mesh is not None:
            return generate_on_mesh(self.mesh, ids, sampling, self.tokenizer, batch_size=None)
        return generate_on_stages(self.stages, [], Mailbox(ByteMeter()), ids, sampling, self.tokenizer, batch_size=None)

    def __call__(self, prompts: list[str], stop: list[str], max_new_tokens: int) -> list[str]:
        from thinpipe.eval.generative import prompt_ids
        from thinpipe.rank.generation import truncate_completion

        sampling = self._sampling(stop, max_new_tokens)
        outs = self._generate([prompt_ids(self.tokenizer, p, max_new_tokens) for p in prompts], sampling)
        return [truncate_completion(o, self.tokenizer, sampling) for o in outs]

    def ids(self, ids: list[list[int]], stop: list[str], max_new_tokens: int) -> list[list[int]]:
        outs = self._generate([list(x) for x in ids], self._sampling(stop, max_new_tokens))
        return [o[:-1] if o and o[-1] == self.eos else o for o in outs]


def mesh_generator(tokenizer, mesh=None, model=None) -> MeshGenerator:
    """``generate_batch`` of ``evaluate_generative`` on ``mesh`` or ``model`` (``MeshGenerator``)."""
    return MeshGenerator(tokenizer, mesh=mesh, model=model)
