"""``thinpipe bench``: methods side by side on this machine through the distributed runtime over
shaped links, each measured tokens/s next to the planner's prediction (issue 7: check the model).

Per arm (a `thinpipe launch` job of the tiny Llama): first a short calibration run measures this
CPU's step time T0 for the arm (its compute profile: forward, backward, optimizer and Python
overhead on this machine's cores, with as many processes as the arm has). It runs over the same
shaped transport as the measured run (sender threads and all) but at 1 Tbit/s and no latency, so
the transport's own CPU cost is in T0 and only the links' rate and latency are left to predict.
An arm with the anchor circuit is calibrated without it: the planner puts the anchor off the
critical path (on its own devices), so T0 is the fast circuit's step alone; on this machine the
anchor's processes share the two cores, and what that costs the fast circuit is left in the error.
(Calibrating with the anchor running over-counts it: with free links the fast ranks never idle, so
the anchor takes CPU from them, while in the shaped run it mostly fills their idle time.)
Then the shaped run is measured: links shaped in the transport, or with ``--netns`` by the kernel
(each rank in its own network namespace, tc rates; root only). Both runs' step times are steady
state: the first ``WARMUP_STEPS`` steps (start-up, first-touch allocation) are left out of each, so
a 60-step calibration and a 120-step run are compared alike (the wall-clock tokens/s, start-up
included, is printed too).

The prediction replays the step in the schedule simulation (``plan/des.py``) with the compute taken
from T0 (an unshaped (M + K - 1)-slot pipeline: f + b = T0 / (M + K - 1), f : b = 1 : 2) and the
shaped links' bandwidth and latency (each message's header included: the link carries it; with
``--netns`` the links are token buckets of the kernel shaper's depth), plus the DP all-reduce's
modelled ring time (``comm/dist_group.py``), MAPL's projector sync (two blocking messages per step) and, for the
anchor, nothing (it is off the critical path).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from thinpipe.comm.netns import KERNEL_BURST_BYTES
from thinpipe.config import ConfigError
from thinpipe.jsonl import read_rows
from thinpipe.plan.des import PipelineStep, simulate
from thinpipe.runlock import check_out_path

NAME = "bench"
HELP = "methods side by side over shaped links, measured vs predicted tokens/s"

BASE = {"model.name": "tiny-llama", "data.name": "synthetic", "mesh.pp": 2, "train.batch_size": 4,
        "train.seq_len": 64, "train.microbatches": 2, "train.lr": 1e-3, "train.checkpoint_every": 0}
ARMS = {
    "Dense": {},
    "M95": {"boundary.kind": "mask", "boundary.p": 0.95},
    "TopK95": {"boundary.kind": "topk", "boundary.p": 0.95},
    "MAPL r16": {"boundary.kind": "mapl", "boundary.rank": 16},
    "Dense, 2 replicas": {"mesh.dp": 2},
    "M95 + PowerSGD r4, 2 replicas": {"boundary.kind": "mask", "boundary.p": 0.95, "mesh.dp": 2,
                                      "dp.kind": "powersgd", "dp.rank": 4, "dp.start_step": 0},
}
# The anchor circuit as its own row of processes: a cycle starts every 4 fast steps (delta = 4 for
# the fixed rule; ``arrival`` consumes each prior as soon as it is there and never waits).
AP = {"mesh.anchor": 1, "anchor.staleness": 4, "anchor.delivery": "arrival"}
ARMS["M95+AP"] = {**ARMS["M95"], **AP}
ARMS["M95+AP, push r4"] = {**ARMS["M95"], **AP, "anchor.push_rank": 4}
ARMS["M95+AP + PowerSGD r4, 2 replicas"] = {**ARMS["M95 + PowerSGD r4, 2 replicas"], **AP, "anchor.push_rank": 4}


class ArmFailed(RuntimeError):
    """One arm's job exited non-zero: recorded with its error, the other arms still run."""


# The calibration run's links: the shaped transport's code path, at a rate that costs no time.
CALIBRATION_MBPS = 1e6


def run_arm(name: str, cfg: dict, out: Path, netns: bool = False) -> dict:
    nproc = cfg["mesh.pp"] * (cfg.get("mesh.dp", 1) + cfg.get("mesh.anchor", 0))
    folder = out / name.replace(" ", "_").replace(",", "").replace("+", "p")
    cmd = [sys.executable, "-m", "thinpipe", "launch", "--nproc", str(nproc)] + (["--netns"] if netns else []) + [
        "--", "train", "--out", str(folder), "--quiet"] + [x for k, v in cfg.items() for x in ("--set", f"{k}={v}")]
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if r.returncode:
        raise ArmFailed(f"{name} failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    walls = [row["wall_s"] for row in read_rows(folder / "metrics.jsonl")]
    summary["steady_step_s"] = steady_step_s(walls)
    return summary


# Steps whose time is left out of a run's step time: process start-up, first-touch allocation and
# kernel selection fall there, and weigh 2x more in a 60-step calibration than in a 120-step run.
WARMUP_STEPS = 5


def steady_step_s(walls: list[float], skip: int = WARMUP_STEPS) -> float:
    """Mean step time after the first ``skip`` steps, from the cumulative wall clock per step."""
    if len(walls) <= skip:
        return walls[-1] / len(walls)
    return (walls[-1] - walls[skip - 1]) / (len(walls) - skip)


def predict_step_s(t0_s: float, shaped: dict, cfg: dict, pp_mbps: float, dp_mbps: float, latency_ms: float,
                   burst_bytes: float = 0.0) -> float:
    """The shaped step time from the calibration run's (see the module docstring); ``burst_bytes``:
    the links' token-bucket depth (the kernel shaper's, with ``--netns``; the transport's is 0)."""
    from thinpipe.comm.header import HEADER_BYTES  # here: the header imports torch; `thinpipe --help` does not

    K, M = cfg["mesh.pp"], cfg["train.microbatches"]
    f_plus_b = t0_s / (M + K - 1)
    tokens = shaped["tokens"] / shaped["steps"]  # per step, all fast replicas
    dp = cfg.get("mesh.dp", 1)
    per_replica = tokens / dp
    b = shaped["bytes_per_token"]
    # one microbatch's message at one boundary; the link carries its header too (the byte meter,
    # like the paper, counts payload only): 792 B, a third of an M95 message of the tiny model
    fwd = b["pp_fwd"] * per_replica / M / (K - 1) + HEADER_BYTES
    bwd = b["pp_bwd"] * per_replica / M / (K - 1) + HEADER_BYTES
    pipe = simulate(PipelineStep(K, M, f_plus_b / 3, 2 * f_plus_b / 3, fwd, bwd, pp_mbps * 1e6 / 8,
                                 latency_ms / 1e3, cfg.get("train.schedule", "1f1b"), burst_bytes))["makespan_s"]
    dp_s = 0.0
    if dp > 1:  # the ring model of DistGroup, per stage group, all stages at once
        per_rank = b["dp"] * tokens / K / dp
        dp_s = per_rank * 8 / (dp_mbps * 1e6) + 2 * (dp - 1) * latency_ms / 1e3
    # MAPL's projector sync rides the PP links (pp_params) once per step as two blocking messages
    # after the pipeline (receiver -> owner dL/dA, then owner -> receiver the new A): their bytes and
    # two latencies are on the critical path
    params_s = ((b["pp_params"] * tokens / (K - 1) / dp + 2 * HEADER_BYTES) * 8 / (pp_mbps * 1e6)
                + 2 * latency_ms / 1e3 if b["pp_params"] else 0.0)
    return pipe + dp_s + params_s


def calibration(base: dict, steps: int) -> dict:
    """The calibration run of an arm: its fast circuit over links that cost nothing (see the
    module docstring)."""
    cfg = {**base, "train.steps": steps, "link.pp_mbps": CALIBRATION_MBPS, "link.dp_mbps": CALIBRATION_MBPS,
           "link.pp_latency_ms": 0, "link.dp_latency_ms": 0}
    if base.get("mesh.anchor"):
        cfg = {k: v for k, v in cfg.items() if not k.startswith("anchor.")} | {"mesh.anchor": 0}
    return cfg


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.description = __doc__.splitlines()[0]
    ap.strict = True  # an unknown argument is `thinpipe bench`'s own one-line error (common.Parser)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--calibration-steps", type=int, default=60)
    ap.add_argument("--pp-mbps", type=float, default=4.0)
    ap.add_argument("--dp-mbps", type=float, default=4.0)
    ap.add_argument("--latency-ms", type=float, default=5.0)
    ap.add_argument("--only", default="", help="arm names separated by ; (e.g. \"Dense;M95\")")
    ap.add_argument("--netns", action="store_true", help="shape the measured runs in the kernel: each rank in its "
                                                         "own network namespace with tc rates (Linux, root)")
    ap.add_argument("--out", default="benchmarks/results/shaped_pipeline.json")


def run(args) -> int:
    only = [a.strip() for a in args.only.split(";") if a.strip()]
    unknown = set(only) - set(ARMS)
    if unknown:
        raise ConfigError(f"--only: unknown arm(s) {sorted(unknown)}: choose from {list(ARMS)}")
    for name in ("steps", "calibration_steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.pp_mbps, args.dp_mbps) <= 0 or args.latency_ms < 0:
        raise ConfigError("--pp-mbps and --dp-mbps must be > 0 and --latency-ms >= 0")
    if Path(args.out).is_dir():  # written after minutes of runs: checked before them
        raise ConfigError(f"--out {args.out} is a folder: give the path of the JSON file to write")
    check_out_path(Path(args.out).parent)
    arms = {k: v for k, v in ARMS.items() if not only or k in only}
    results, failed = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets in arms.items():
            base = {**BASE, **sets}
            links = {"link.pp_mbps": args.pp_mbps, "link.pp_latency_ms": args.latency_ms,
                     "link.dp_mbps": args.dp_mbps, "link.dp_latency_ms": args.latency_ms}
            if args.netns:
                links["link.shaper"] = "kernel"
            try:
                t0 = run_arm(name + " calibration", calibration(base, args.calibration_steps), Path(tmp))
                shaped = run_arm(name, {**base, "train.steps": args.steps, **links}, Path(tmp), netns=args.netns)
            except ArmFailed as e:
                failed[name] = str(e)
                print(f"FAILED {name}: {e}", file=sys.stderr, flush=True)
                continue
            step0 = t0["steady_step_s"]
            burst = KERNEL_BURST_BYTES if args.netns else 0.0
            predicted = shaped["tokens"] / shaped["steps"] / predict_step_s(step0, shaped, base, args.pp_mbps,
                                                                            args.dp_mbps, args.latency_ms, burst)
            results[name] = (shaped, step0, predicted)
            print(f"done {name}", file=sys.stderr, flush=True)

    def steady_tps(s: dict) -> float:
        return s["tokens"] / s["steps"] / s["steady_step_s"]

    dense = steady_tps(results["Dense"][0]) if "Dense" in results else None
    head = (f"{'arm':<34}{'tok/s':>8}{'predicted':>11}{'error':>8}{'(wall)':>8}{'vs Dense':>10}{'PP B/tok':>10}"
            f"{'DP B/tok':>10}{'anc B/tok':>11}{'held-out':>10}{'priors':>8}{'stale':>7}")
    print(head + "\n" + "-" * len(head))
    rows = {}
    for name, (s, step0, predicted) in results.items():
        b = s["bytes_per_token"]
        pp = b["pp_fwd"] + b["pp_bwd"] + b["pp_params"]
        stale = s.get("anchor_staleness_mean")
        tps = steady_tps(s)
        err = predicted / tps - 1
        rows[name] = {"tokens_per_s": tps, "tokens_per_s_wall": s["tokens_per_s"], "predicted_tokens_per_s": predicted,
                      "relative_error": err, "calibration_step_s": step0, "steady_step_s": s["steady_step_s"],
                      "ratio_vs_dense": tps / dense if dense else None,
                      "pp_bytes_per_token": pp, "dp_bytes_per_token": b["dp"], "anchor_bytes_per_token": b["anchor"],
                      "bytes_per_token": b,
                      "final_val_loss": s["final_val_loss"], "wall_s": s["wall_s"],
                      "priors_consumed": s.get("priors_consumed"), "anchor_staleness_mean": stale,
                      "anchor_staleness_max": s.get("anchor_staleness_max"), "anchor_wait_s": s.get("anchor_wait_s")}
        ratio = f"{tps / dense:.2f}x" if dense else "-"
        print(f"{name:<34}{tps:>8.0f}{predicted:>11.0f}{err:>+8.0%}{s['tokens_per_s']:>8.0f}{ratio:>10}{pp:>10.0f}"
              f"{b['dp']:>10.0f}"
              f"{b['anchor']:>11.0f}{s['final_val_loss']:>10.4f}{s.get('priors_consumed', '-'):>8}"
              f"{'-' if stale is None else f'{stale:.1f}':>7}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name, why in failed.items():
        print(f"{name:<34}  FAILED: {why.splitlines()[0]}")
    Path(args.out).write_text(json.dumps({"args": vars(args), "base": BASE, "arms": arms, "results": rows,
                                          "failed": failed}, indent=2))
    print(f"saved {args.out}")
    return 1 if failed else 0
