"""The one command line: ``thinpipe train | launch | plan | bench | probe | eval | compare | export | prune | analyze |
keygen | demo``.

User errors (bad keys, types, values, paths, names) end with one line ``error: ...`` saying what is
wrong and how to fix it, and exit code 2, before any model or data is loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from thinpipe.comm.jobkey import KEY_ENV, write_key_file
from thinpipe.config import ConfigError, Diverged, load_config
from thinpipe.config.errors import report
from thinpipe.eval.sandbox import SandboxUnavailable
from thinpipe.log import say
from thinpipe.plugins import PluginError, load_plugins
from thinpipe.preflight import check_out, check_run, claim_out, validate_names, validate_tasks
from thinpipe.runlock import RunLock, check_out_path, take_run_lock

EXIT_USAGE = 2
EXIT_DIVERGED = 3
def cmd_train(args) -> int:
    cfg = load_config(args.config, args.set)
    out = Path(args.out)
    if args.engine != "elastic":  # an elastic job's folder is its launcher's to claim (replicas write sub-folders)
        check_out(out, args.resume, args.overwrite)
    if args.init_from and args.engine == "elastic":
        raise ConfigError("--init-from is not taken by --engine elastic (its replicas would each export the weights): "
                          "export once with `thinpipe export` and give the folder as --set model.name=FOLDER")
    init = None
    if args.init_from:
        from thinpipe.runs import read_init

        if args.resume:
            raise ConfigError("--init-from starts a new run from other weights, --resume continues this one: give one")
        # read before --overwrite removes anything (the process that removes holds the weights first)
        init = read_init(args.init_from, out, load=os.environ.get("LOCAL_RANK", "0") == "0")
    else:
        validate_names(cfg)  # before the folder is made
    # one job per folder (runlock.py): a rank of `thinpipe launch` is not refused, rank 0 of torchrun takes it
    lock = RunLock() if args.engine == "elastic" else take_run_lock(
        out, lead=args.engine != "dist" or os.environ.get("RANK", "0") == "0", create=not args.resume)
    with lock:
        if args.engine != "elastic":
            claim_out(out, args.resume, args.overwrite)
        if init is not None:
            from thinpipe.runs import init_weights

            cfg.model.init_from = str(Path(args.init_from).resolve())
            cfg.model.name = str(init_weights(init, out / "init"))
            validate_names(cfg)
        return _train(args, cfg)


def _train(args, cfg) -> int:
    if args.engine == "elastic":
        # torchft is needed only here (an optional dependency: pip install torchft); its Rust logger
        # reads RUST_LOG when imported: per-quorum INFO lines off (thinpipe writes events.jsonl)
        os.environ.setdefault("RUST_LOG", "warn")
        from thinpipe.engine.elastic import check_elastic, replica_folder, train_elastic

        check_elastic(cfg)
        if args.resume:
            raise ConfigError("an elastic job resumes through its launcher: thinpipe launch --elastic --resume -- train "
                              "--out ... (each replica continues from its newest checkpoint)")
        summary = train_elastic(cfg, args.out, progress=not args.quiet)
        if summary is not None:
            print_summary(summary, replica_folder(Path(args.out), summary["replica"], summary["restart"]))
        return 0
    if args.engine == "dist":
        from thinpipe.engine.dist import check_supported, train_dist
        from thinpipe.engine.run import resolve_resume

        check_supported(cfg)
        cfg = resolve_resume(cfg, Path(args.out), args.resume)
        summary = train_dist(cfg, args.out, progress=not args.quiet, resume=args.resume)
        if summary is not None:
            print_summary(summary, Path(args.out))
        return 0
    from thinpipe.engine.run import train

    summary = train(cfg, args.out, resume=args.resume, progress=not args.quiet)
    print_summary(summary, Path(args.out))
    return 0


def cmd_launch(args) -> int:
    """N local processes of `thinpipe train --engine dist` (``thinpipe/launch.py``), optionally each
    in its own network namespace (``--netns``, kernel-shaped links)."""
    from thinpipe.launch import launch

    rest = [a for a in args.rest if a != "--"]
    if rest[:1] == ["train"]:  # the ranks' arguments, checked once here: argparse's line once, not once per rank
        try:
            build_parser().parse_args(rest)
        except SystemExit as e:
            return int(e.code or 0)
    if args.elastic:
        os.environ.setdefault("RUST_LOG", "warn")  # as in cmd_train, before torchft is imported
        from thinpipe.launch_elastic import launch_elastic

        if args.netns:
            raise ConfigError("--elastic does not run in network namespaces yet: drop --netns (or --elastic)")
        if args.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        return launch_elastic(args.rest, args.max_restarts, nproc=args.nproc)
    if args.nproc is None:
        raise ConfigError("thinpipe launch needs --nproc N (N = (mesh.dp + mesh.anchor) x mesh.pp)")
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    return launch(args.nproc, args.rest, netns=args.netns)


def cmd_plan(args) -> int:
    """Predicted step time, tokens/s, bytes per token and anchor staleness (``thinpipe/plan/command.py``)."""
    from thinpipe.plan.command import run_plan

    return run_plan(args)


def print_summary(summary: dict, out: Path) -> None:
    rows = [("steps", summary["steps"]), ("tokens", summary["tokens"]),
            ("held-out loss: start", f"{summary['initial_val_loss']:.4f}"),
            ("held-out loss: end", f"{summary['final_val_loss']:.4f}"),
            ("held-out perplexity", f"{summary['val_ppl']:.2f}"),
            ("wall", f"{summary['wall_s']:.1f} s ({summary['tokens_per_s']:.0f} tok/s)")]
    rows += [(f"bytes/token {axis}", f"{v:.1f}") for axis, v in summary["bytes_per_token"].items() if v]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"results in {out}/ (summary.json, metrics.jsonl, loss.png)")


def cmd_eval(args) -> int:
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
        raise ConfigError(f"--max-new-tokens must be >= 1 and --timeout > 0, got {args.max_new_tokens}, {args.timeout}")
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
        from thinpipe.runs import load_mesh, load_run

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


def cmd_compare(args) -> int:
    """Runs side by side: held-out loss for bytes (``thinpipe/compare.py``)."""
    from thinpipe.compare import compare, format_table, write

    if args.out:
        check_out_path(Path(args.out))
    result = compare(args.runs)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    if args.out:
        print(f"wrote {write(result, args.out)}/compare.json and compare.png")
    return 0


def cmd_export(args) -> int:
    from thinpipe.runs import export

    run = Path(args.run)
    check_run(run)
    out = export(run, args.out, overwrite=args.overwrite)
    print(f"exported to {out} (load with AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def cmd_prune(args) -> int:
    """Global magnitude pruning of a run at each sparsity, re-evaluated (thinpipe/prune.py)."""
    from thinpipe.prune import parse_sparsities, prune_sweep

    run = Path(args.run)
    check_run(run)
    if args.out:
        check_out_path(Path(args.out))
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    validate_tasks(tasks)
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    result = prune_sweep(run, parse_sparsities(args.sparsity), tasks, args.limit, Path(args.out) if args.out else None,
                         args.device)
    head = f"{'sparsity':>9}{'zeros':>12}{'held-out':>10}{'ppl':>9}" + "".join(f"{t + ' acc_norm':>22}" for t in tasks)
    print(head)
    for r in result["rows"]:
        print(f"{r['sparsity']:>9.2f}{r['zeros']:>12}{r['val_loss']:>10.4f}{r['val_ppl']:>9.2f}"
              + "".join(f"{r[t + '_acc_norm']:>22.4f}" for t in tasks))
    print(f"saved {Path(args.out) if args.out else run / 'prune'}/ (prune.json, prune.png)")
    return 0


def cmd_analyze(args) -> int:
    from thinpipe.analyze import analyze_run

    if args.batches < 1:
        raise ConfigError(f"--batches must be >= 1, got {args.batches}")
    result, paths = analyze_run(args.run, args.batches, args.device)
    print(f"{'boundary':<9}{'kind':<9}{'r(90%)':>7}{'r(99%)':>7}{'rank':>6}{'captured':>10}{'fixed':>8}{'pca':>7}"
          f"{'cos r':>7}")
    for row in result["boundaries"]:
        cap = (f"{row.get('rank', ''):>6}{row['captured_energy']:>10.3f}{row['captured_energy_fixed_random']:>8.3f}"
               f"{row['captured_energy_best']:>7.3f}{row['cosine_pearson']:>7.3f}" if "captured_energy" in row else "")
        print(f"{row['index']:<9}{row['kind']:<9}{row['rank_for_90']:>7}{row['rank_for_99']:>7}{cap}")
    if "principal_angles_deg" in result:
        print("mean principal angles (deg):")
        for line in result["principal_angles_deg"]:
            print("  " + " ".join(f"{a:6.1f}" for a in line))
    print(f"wrote {Path(args.run) / 'analysis' / 'analysis.json'} and {', '.join(p.name for p in paths)}")
    return 0


def cmd_probe(args) -> int:
    from thinpipe.probe import command

    cfg = load_config(args.config, ([f"model.name={args.model}"] if args.model else []) + args.set)
    validate_names(cfg)
    if args.out:
        check_out_path(Path(args.out))
    return command(cfg, args)


def cmd_demo(args) -> int:
    from thinpipe.demo import run_demo

    return run_demo(args.out, quick=args.quick)


class _Parser(argparse.ArgumentParser):
    """argparse's errors as one line (``error: ...``, exit 2) like every other bad input, not usage + error."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _device(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: give auto, cpu, cuda or cuda:N")
    return value


def _device_arg(p) -> None:
    p.add_argument("--device", default="auto", type=_device,
                   help="auto (CUDA when available) | cpu | cuda | cuda:N; a run loads on any device, whatever it "
                        "trained on")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="thinpipe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train on the simulated mesh")
    t.add_argument("--config", help="TOML config file")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. mesh.pp=4")
    t.add_argument("--out", required=True, help="run folder (config, metrics, summary, plot, checkpoint)")
    t.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace the run in --out (without it, a folder that "
                                                            "holds a run is refused)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--init-from", metavar="RUN_OR_HF_FOLDER", help="start from these weights (a run folder or a Hugging "
                   "Face folder), with a fresh optimizer and schedule: a second phase, e.g. SFT after pretraining")
    t.add_argument("--engine", choices=["sim", "dist", "elastic"], default="sim",
                   help="sim: the whole mesh in this process (default); dist: this process is one rank (torchrun); "
                        "elastic: one stage of replica $REPLICA_GROUP_ID on torchft (thinpipe launch --elastic)")
    t.set_defaults(func=cmd_train)

    la = sub.add_parser("launch", help="run a dist training job as N local processes")
    la.add_argument("--nproc", type=int, help="processes = (mesh.dp + mesh.anchor) x mesh.pp (with --elastic: "
                                              "optional, mesh.dp x mesh.pp)")
    la.add_argument("--elastic", action="store_true", help="replicas that may fail and come back (torchft): a "
                    "lighthouse, one torch.distributed world per replica, dead replicas restarted (docs/elastic.md)")
    la.add_argument("--max-restarts", type=int, default=3, help="with --elastic: restarts per replica (default 3)")
    la.add_argument("--netns", action="store_true",
                    help="each rank in its own network namespace, link.pp_mbps / link.dp_mbps enforced by the "
                         "kernel (tc); Linux, root")
    la.add_argument("rest", nargs=argparse.REMAINDER, help="-- train --out DIR --set ...")
    la.set_defaults(func=cmd_launch)

    pl = sub.add_parser("plan", help="predict step time, tokens/s, bytes and anchor staleness (paper App. H, J)")
    pl.add_argument("--preset", help="a deployment preset, e.g. paper-llama1b")
    pl.add_argument("--config", help="TOML config file")
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. boundary.p=0.95")
    pl.add_argument("--device", help="a100-40gb | h100 | rtx-4090 (data sheet) | cpu | cuda | cuda:N (measured here, "
                                     "cached) (default: the preset's, else a100-40gb)")
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.add_argument("--replica-mtbf-h", type=float, help="elastic replicas (docs/elastic.md): each fails this often "
                    "(hours, mean); adds the expected tokens/s with that churn")
    pl.add_argument("--restart-s", type=float, default=60.0, help="with --replica-mtbf-h: seconds to start a lost "
                                                                  "replica again, model load included (60)")
    pl.add_argument("--remeasure", action="store_true", help="with --device cpu or cuda: measure again instead of the "
                                                             "cached profile (do it on an idle machine)")
    pl.add_argument("--target-tps", type=float, help="advice: the least compression (mask p, PowerSGD rank, DiLoCo H) "
                                                     "reaching this many tokens/s (exit 1 if none can)")
    pl.add_argument("--max-mbps", type=float, help="advice: every link at this many Mbit/s; without --target-tps, the "
                                                   "least compression at which the links keep up with compute (overlapped)")
    pl.add_argument("--probe", help="advice within a quality bound: a probe.json of `thinpipe probe` (same model, stages)")
    pl.add_argument("--max-damage", type=float, default=0.01, help="with --probe: the largest forward damage accepted, "
                                                                    "a fraction of the dense held-out loss (0.01)")
    pl.set_defaults(func=cmd_plan)

    bn = sub.add_parser("bench", help="methods side by side over shaped links, measured vs predicted tokens/s",
                        add_help=False)
    bn.add_argument("rest", nargs=argparse.REMAINDER, help="see thinpipe bench --help")

    e = sub.add_parser("eval", help="multiple-choice (lm-eval formats) and generative (gsm8k, humaneval, mbpp) evaluation")
    e.add_argument("--model", default="default", help="default | preset | HF folder | thinpipe run folder")
    e.add_argument("--tasks", required=True, help="comma-separated, e.g. arc_easy,piqa,hellaswag or gsm8k,humaneval,mbpp")
    e.add_argument("--limit", type=int, default=None, help="items per task")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--max-new-tokens", type=int, default=256, help="generative tasks: tokens per completion")
    e.add_argument("--timeout", type=float, default=10.0, help="humaneval / mbpp: seconds per program in the sandbox")
    e.add_argument("--samples", help="write every completion and its verdict to this JSON file")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _device_arg(e)
    e.set_defaults(func=cmd_eval)

    x = sub.add_parser("export", help="write a run's weights as a Hugging Face model folder")
    x.add_argument("--run", required=True)
    x.add_argument("--out", required=True, help="a new or empty folder, or an earlier export with --overwrite")
    x.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out (only its own files; "
                                                            "any other non-empty folder is refused)")
    x.set_defaults(func=cmd_export)

    pr = sub.add_parser("prune", help="post-hoc global magnitude pruning at several sparsities, re-evaluated (§5.5)")
    pr.add_argument("--run", required=True, help="a run folder (config.toml + checkpoint/)")
    pr.add_argument("--sparsity", default="0,0.1,0.2,0.3,0.4,0.5", help="comma-separated fractions of the decoder "
                                                                       "matrices' weights to zero")
    pr.add_argument("--tasks", default="", help="also multiple-choice accuracy on these tasks, e.g. arc_easy,piqa")
    pr.add_argument("--limit", type=int, help="items per task")
    pr.add_argument("--out", help="where prune.json / prune.png go (default: RUN/prune)")
    _device_arg(pr)
    pr.set_defaults(func=cmd_prune)

    a = sub.add_parser("analyze", help="boundary spectra, projector angles, captured energy (MAPL Fig. 3-5)")
    a.add_argument("--run", required=True, help="a run folder (config.toml + checkpoint/)")
    a.add_argument("--batches", type=int, default=4, help="validation batches to analyse")
    _device_arg(a)
    a.set_defaults(func=cmd_analyze)

    q = sub.add_parser("probe", help="each boundary kind's forward damage, gradient alignment and bytes, no training")
    q.add_argument("--model", help="the model (model.name), e.g. smollm2-135m")
    q.add_argument("--config", help="TOML config file (mesh.pp, data, train.seq_len, train.batch_size apply)")
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. mesh.pp=4")
    q.add_argument("--kinds", help="comma-separated boundary kinds to probe (default: every kind of the grid)")
    q.add_argument("--boundaries", help="comma-separated boundary indices to compress (default: all)")
    q.add_argument("--batches", type=int, default=4, help="held-out batches per arm")
    q.add_argument("--out", help="write probe.json and probe.png (loss against bytes) here")
    q.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    _device_arg(q)
    q.set_defaults(func=cmd_probe)

    cp = sub.add_parser("compare", help="runs side by side: held-out loss, bytes per token, compression, tokens/s")
    cp.add_argument("runs", nargs="+", metavar="RUN", help="run folders (--out of `thinpipe train`)")
    cp.add_argument("--out", help="write compare.json and compare.png (held-out loss against step and PP bytes) here")
    cp.add_argument("--json", action="store_true", help="print JSON instead of the table")
    cp.set_defaults(func=cmd_compare)
    k = sub.add_parser("keygen", help="write a new job key (for a dist job across machines: docs/security.md)")
    k.add_argument("file", metavar="KEYFILE", help="where to write it (mode 0600; never overwritten)")
    k.set_defaults(func=cmd_keygen)
    d = sub.add_parser("demo", help="the main job: SmolLM2 on math, 4 stages, dense vs M95")
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--quick", action="store_true", help="tiny model, seconds (for tests)")
    d.set_defaults(func=cmd_demo)
    return p


def cmd_keygen(args) -> int:
    path = write_key_file(args.file)
    say(f"wrote a job key to {path}: copy it to every machine of the job (scp; never into a config or a run folder) "
        f"and set {KEY_ENV}={path} for each rank")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        load_plugins()  # boundary kinds named in THINPIPE_PLUGINS (plugins.py)
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if argv[:1] == ["bench"]:  # its own options (thinpipe/bench.py)
        from thinpipe.bench import main as bench

        try:
            return bench(argv[1:])
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
        except SystemExit as e:  # --help (0) or a usage error, already printed as one line (2)
            return int(e.code or 0)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error, already printed as one line (2)
        return int(e.code or 0)
    try:
        return args.func(args)
    except ConfigError as e:
        report(str(e))  # a rank of `thinpipe launch` hands it to the launcher: the job prints it once
        return EXIT_USAGE
    except SandboxUnavailable as e:  # a machine that cannot isolate generated code: it is never run
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
