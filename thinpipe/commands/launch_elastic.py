"""``thinpipe launch --elastic``: a job whose replicas may die and come back, on one machine (torchft).

It starts torchft's lighthouse, then each replica as its own torch.distributed world of
``mesh.pp`` processes (``train --engine elastic``, ``engine/elastic_rank.py``), and watches them:

* a process of a replica that fails (an exit code, a signal) takes its replica out: the replica's
  other processes are stopped (a pipeline cannot run without a stage, and a stage left alive would
  keep heartbeating for a replica that no longer trains), the other replicas go on with a smaller
  quorum, and the replica is started again (``--max-restarts`` per replica), recovering the job's
  state from a live peer;
* a replica whose processes all end with 0 has finished; the job ends when every replica has
  finished or is given up, with exit 0 if one finished;
* every change goes to ``OUT/events.jsonl`` (``replica_started``, ``replica_failed``,
  ``replica_restarted``, ``replica_given_up``, ``job_finished``; the replicas add ``quorum``,
  ``rolled_back``, ``recovered``), and at the end ``OUT/summary.json`` and ``OUT/metrics.jsonl`` say
  what the job did as a whole, next to its ``config.toml`` (``elastic_summary``): the folder reads as
  any run's (``thinpipe compare``).

Across machines the same job is one ``torchft_lighthouse`` and one torchrun per replica
(docs/elastic.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

from torchft.coordination import LighthouseServer

from thinpipe.checkpoint import has_checkpoint
from thinpipe.comm.bind import BIND_ENV, LOOPBACK, bind_address
from thinpipe.comm.orphan import WATCH_ENV
from thinpipe.commands.launching import INTERRUPTED, failures, free_port, how, job_key_env, stop, train_args
from thinpipe.commands.preflight import made_by_thinpipe, validate_names
from thinpipe.commands.rank_starter import RankStarter
from thinpipe.config import ConfigError, load_config
from thinpipe.console import say
from thinpipe.engine.elastic_setup import (
    LIGHTHOUSE_ENV,
    REPLICA_ENV,
    RESTART_ENV,
    RESUME_ENV,
    advertised,
    check_elastic,
    quiet_torchft,
    replica_folder,
)
from thinpipe.events import EVENTS, append_event, read_events
from thinpipe.jsonl import read_rows
from thinpipe.provenance import code_stamp
from thinpipe.runlock import RunLock, check_out_path, take_run_lock

USAGE_ERROR = 2  # the CLI's exit code for bad input: restarting would only repeat it
JOB_FILES = (EVENTS, "summary.json", "metrics.jsonl", "config.toml")
REPLICA_KEYS = ("replica", "restart", "members_at_end", "rollbacks", "recovered_at_step", "recovery_s", "world_size")


def claim_job(out: Path, overwrite: bool, resume: bool = False) -> RunLock:
    """The job's folder lock (``runlock.py``: its replicas inherit it), then with --overwrite the files of
    the earlier job removed: its own names and replica folders only, and only from a thinpipe folder."""
    check_out_path(out)
    folders = [p.name for p in out.glob("replica*") if p.is_dir() and re.fullmatch(r"replica\d+(-restart\d+)?", p.name)]
    held = sorted([n for n in JOB_FILES if (out / n).exists()] + folders)
    if held and not resume and not overwrite:
        raise ConfigError(f"--out {out} holds an elastic job ({', '.join(held[:4])}"
                          f"{', ...' if len(held) > 4 else ''}): add --overwrite to replace it, or choose another "
                          "--out")
    if held and not resume and not made_by_thinpipe(out):
        raise ConfigError(f"--out {out} holds {', '.join(held[:4])} but no thinpipe job: --overwrite removes only a "
                          "job's files; choose another --out")
    lock = take_run_lock(out, job=True)
    if not resume:
        for n in held:
            shutil.rmtree(out / n) if (out / n).is_dir() and not (out / n).is_symlink() else (out / n).unlink()
    return lock


class Replica:
    """One replica's processes (its stages), the folder they write (``attempt``: replica{r}-restart{attempt})
    and how often this launch restarted it."""

    def __init__(self, index: int, attempt: int = 0, resume: bool = False):
        self.index, self.attempt, self.top, self.resume = index, attempt, attempt, resume
        self.restarts, self.procs = 0, []
        self.state = "running"  # running | finished | given_up
        self.env: dict[str, str] = {}  # what every process of the job gets besides os.environ (its job key)

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]


def launch_elastic(rest: list[str], max_restarts: int, nproc: int | None = None,
                   start_method: str = "forkserver") -> int:
    args = train_args(rest)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config")
    p.add_argument("--recipe")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--resume", action="store_true")
    known, _ = p.parse_known_args(args[1:])
    cfg = load_config(known.config, known.set, recipe=known.recipe)
    check_elastic(cfg)
    validate_names(cfg)  # before any process starts: a bad model or data name is one line here, not R x PP
    dp, pp = cfg.mesh.dp, cfg.mesh.pp
    if nproc is not None and nproc != dp * pp:
        raise ConfigError(f"--nproc {nproc} does not match an elastic job of mesh.dp x mesh.pp = {dp} x {pp} = "
                          f"{dp * pp} processes: give --nproc {dp * pp} or leave it out")
    out = Path(known.out)
    if known.resume and known.overwrite:
        raise ConfigError("--resume continues the job in --out, --overwrite replaces it: give one of them")
    replicas = resume_plan(out, dp) if known.resume else [Replica(r) for r in range(dp)]
    lock = claim_job(out, known.overwrite, known.resume)
    e = cfg.elastic
    quiet_torchft()  # before the lighthouse starts: the replicas inherit RUST_LOG
    try:
        lighthouse, address = start_lighthouse(e)
    except BaseException:
        lock.release()  # no job started: the folder is free again
        raise
    say(f"[thinpipe launch] elastic job: {dp} replicas x {pp} stages, lighthouse at {address}, up to {max_restarts} "
        f"restarts per replica; events in {out / EVENTS}")
    if known.resume:
        append_event(out, "job_resumed", folders={rep.index: replica_folder(out, rep.index, rep.attempt).name
                                                  for rep in replicas}, from_checkpoint=[rep.index for rep in replicas
                                                                                         if rep.resume])
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    t0 = time.time()
    argv = [*[a for a in args if a not in ("--overwrite", "--resume")], "--engine", "elastic"]
    # each replica's stages forked from a server that has imported torch, torchft and the engine (rank_starter.py)
    starter = RankStarter(["thinpipe.engine.elastic_rank", "thinpipe.cli"], os.environ.get("OMP_NUM_THREADS", "1"),
                          start_method)
    keys = contextlib.ExitStack()  # the job key's folder goes when the replicas have stopped
    try:
        key_env = {**keys.enter_context(job_key_env()), BIND_ENV: LOOPBACK}
        for rep in replicas:
            rep.env = key_env
            _start(rep, starter, argv, pp, address, out, t0)
        code = _supervise(replicas, starter, argv, pp, address, out, t0, max_restarts, interrupted)
        if code == INTERRUPTED:
            say("[thinpipe launch] interrupted: stopping every replica")
            return code
        model = None
        if code == 0:  # the job's model on this machine, from the replicas' folders (docs/data.md)
            from thinpipe.engine.run_folder import write_run_model  # the model libraries: loaded at the end only

            model = write_run_model(out)
        summary = elastic_summary(out, cfg, model)
        say(f"[thinpipe launch] elastic job {'done' if code == 0 else f'ended with exit code {code}'}: "
            f"{summary['replicas_finished']} of {dp} replicas finished, {summary['restarts']} restarts, "
            f"{summary['steps_redone']} steps redone; {out / 'summary.json'}")
        return code
    finally:
        for rep in replicas:
            stop(rep.procs)
        keys.close()
        signal.signal(signal.SIGINT, previous)
        lighthouse.shutdown()
        lock.release()


def start_lighthouse(e) -> tuple[LighthouseServer, str]:
    """torchft's lighthouse on the job's address (``comm/bind.py``: loopback for this one-machine job,
    ``$THINPIPE_BIND_ADDR`` when set), and the address its replicas reach it at (torchft's own
    ``address()`` names the host, which need not resolve to the address it listens on)."""
    addr = bind_address()
    try:
        lighthouse = LighthouseServer(bind=f"{addr}:0", min_replicas=e.min_replicas,
                                      join_timeout_ms=int(e.join_timeout_s * 1000), quorum_tick_ms=100,
                                      heartbeat_timeout_ms=int(e.heartbeat_timeout_s * 1000))
    except RuntimeError as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"cannot start torchft's lighthouse on {addr} ({why}): check ${BIND_ENV}") from None
    port = lighthouse.address().rpartition(":")[2]
    return lighthouse, f"http://{advertised(addr)}:{port}"


def _start(rep: Replica, starter: RankStarter, argv: list[str], pp: int, lighthouse: str, out: Path, t0: float) -> None:
    port = free_port()
    rep.procs = []
    for s in range(pp):
        env = {**os.environ, **rep.env, "RANK": str(s), "WORLD_SIZE": str(pp), "LOCAL_RANK": str(s),
               "LOCAL_WORLD_SIZE": str(pp), "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port),
               WATCH_ENV: str(os.getpid()),
               REPLICA_ENV: str(rep.index), RESTART_ENV: str(rep.attempt), LIGHTHOUSE_ENV: lighthouse,
               RESUME_ENV: "1" if rep.resume else "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        rep.procs.append(starter.start(argv, env, f"thinpipe replica {rep.index} stage {s} (restart {rep.attempt})"))
    rep.state = "running"
    append_event(out, "replica_started" if rep.restarts == 0 else "replica_restarted", replica=rep.index,
                 restart=rep.attempt, wall_s=round(time.time() - t0, 3), folder=replica_folder(out, rep.index,
                                                                                               rep.attempt).name)


def _supervise(replicas: list[Replica], starter: RankStarter, argv: list[str], pp: int, lighthouse, out: Path,
               t0: float, max_restarts: int, interrupted: threading.Event) -> int:
    while True:
        if interrupted.is_set():
            return INTERRUPTED
        for rep in replicas:
            if rep.state != "running":
                continue
            codes = rep.codes()
            failed = failures(codes)
            if failed:
                stage, code = failed[0]
                stop(rep.procs, grace_s=5.0)
                append_event(out, "replica_failed", replica=rep.index, stage=stage, how=how(code),
                             restart=rep.attempt, wall_s=round(time.time() - t0, 3))
                if code == USAGE_ERROR:  # a user error (its one line is above): every replica would hit it
                    say(f"[thinpipe launch] replica {rep.index} stopped on an input error (exit 2): stopping the job")
                    append_event(out, "job_stopped", why="an input error", wall_s=round(time.time() - t0, 3))
                    return USAGE_ERROR
                others = [o for o in replicas if o is not rep]
                if others and all(o.state != "running" for o in others):
                    rep.state = "given_up"  # nobody left to recover the job's state from: the job is over
                    say(f"[thinpipe launch] replica {rep.index} lost (stage {stage}: {how(code)}) after the others "
                        "ended: not restarted")
                    append_event(out, "replica_given_up", replica=rep.index, why="the other replicas had ended",
                                 wall_s=round(time.time() - t0, 3))
                elif rep.restarts < max_restarts:
                    say(f"[thinpipe launch] replica {rep.index} lost (stage {stage}: {how(code)}); the others go on; "
                        f"restarting it ({rep.restarts + 1} of {max_restarts})")
                    rep.restarts += 1
                    rep.top = rep.attempt = rep.top + 1  # a new folder; it recovers from a live peer
                    rep.resume = False
                    _start(rep, starter, argv, pp, lighthouse, out, t0)
                else:
                    rep.state = "given_up"
                    say(f"[thinpipe launch] replica {rep.index} lost (stage {stage}: {how(code)}) after {max_restarts} "
                        "restarts: the others go on without it")
                    append_event(out, "replica_given_up", replica=rep.index, wall_s=round(time.time() - t0, 3))
            elif all(c == 0 for c in codes):
                rep.state = "finished"
        for rep in replicas:
            # a restarted replica that has not recovered yet when every other one has ended would train
            # alone from the initial weights: it is stopped instead
            if (rep.state == "running" and rep.attempt and not rep.resume
                    and all(o.state != "running" for o in replicas if o is not rep)
                    and not _recovered(out, rep)):
                stop(rep.procs, grace_s=5.0)
                rep.state = "given_up"
                say(f"[thinpipe launch] replica {rep.index} restarted after the others ended: stopped")
                append_event(out, "replica_given_up", replica=rep.index, why="the other replicas ended before it "
                             "rejoined", wall_s=round(time.time() - t0, 3))
        if all(rep.state != "running" for rep in replicas):
            finished = sum(rep.state == "finished" for rep in replicas)
            append_event(out, "job_finished", replicas_finished=finished, wall_s=round(time.time() - t0, 3))
            return 0 if finished else 1
        time.sleep(0.2)


def _recovered(out: Path, rep: Replica) -> bool:
    return any(e["event"] == "recovered" and e["replica"] == rep.index and e["restart"] == rep.attempt
               for e in read_events(out))


def resume_plan(out: Path, dp: int) -> list[Replica]:
    """``--resume``: each replica continues in its newest folder that holds a checkpoint; one with none
    starts a new folder and recovers from a peer (``engine/elastic_rank.py``)."""
    if not (out / EVENTS).is_file():
        raise ConfigError(f"--resume: {out} holds no elastic job (no {EVENTS}); start one without --resume")
    plan = []
    for r in range(dp):
        attempts = sorted(n for p in out.glob(f"replica{r}*") if p.is_dir() and _folder_order(p)[0] == r
                          for n in [-_folder_order(p)[1]])
        with_ckpt = [n for n in attempts if has_checkpoint(replica_folder(out, r, n))]
        if with_ckpt:
            rep = Replica(r, with_ckpt[-1], resume=True)
            rep.top = attempts[-1]
        else:
            rep = Replica(r, attempts[-1] + 1 if attempts else 0)
        plan.append(rep)
    if not any(rep.resume for rep in plan):
        raise ConfigError(f"--resume: no replica folder in {out} holds a checkpoint (train.checkpoint_every); start "
                          "the job again with --overwrite")
    return plan


def elastic_summary(out: Path, cfg, model: Path | None = None) -> dict:
    """``OUT/summary.json`` and ``OUT/metrics.jsonl`` of a whole elastic job, from its replicas' folders and events.

    metrics.jsonl: for every step, the row of the first replica (lowest index, then latest restart)
    that committed it (a row's loss and bytes are the job's: every replica present computed the same).
    """
    events = read_events(out)
    folders = sorted((p for p in out.glob("replica*") if p.is_dir()), key=_folder_order)
    summaries = {p.name: json.loads((p / "summary.json").read_text()) for p in folders
                 if (p / "summary.json").is_file()}
    rows: dict[int, dict] = {}
    for p in folders:
        if (p / "metrics.jsonl").is_file():
            for m in read_rows(p / "metrics.jsonl"):  # a replica killed mid-row leaves a cut-off last line
                rows.setdefault(m["step"], m)
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(rows[s]) + "\n" for s in sorted(rows))
    failed = [e for e in events if e["event"] == "replica_failed"]
    recovered = [e for e in events if e["event"] == "recovered"]
    rejoins = []
    for e in recovered:
        lost = [f for f in failed if f["replica"] == e["replica"] and f["time"] <= e["time"]]
        rejoins.append({"replica": e["replica"], "at_step": e["step"], "restart": e["restart"],
                        "rejoin_s": round(e["time"] - lost[-1]["time"], 3) if lost else None})
    quorum = [e for e in events if e["event"] == "quorum"]
    missed = 0  # replica-steps the job trained without some replica
    for i, q in enumerate(quorum):
        end = quorum[i + 1]["step"] if i + 1 < len(quorum) else cfg.train.steps
        missed += (cfg.mesh.dp - len(q["members"])) * (end - q["step"])
    first = next((summaries[p.name] for p in folders if p.name in summaries), None)
    # the first replica's summary is the job's (as --engine dist reports replica 0's), so that
    # `thinpipe compare` reads an elastic job's folder as any run's; what is one replica's own goes
    job = {k: v for k, v in (first or {}).items() if k not in REPLICA_KEYS}
    # the objective's held-out measure (its ObjectiveSpec.val_key: val_loss, GSPO's val_accuracy), as every replica
    # wrote it
    final = f"final_{(first or {}).get('val_key', 'val_loss')}"
    summary = {
        **job, "engine": "elastic", "replicas": cfg.mesh.dp, "stages": cfg.mesh.pp, "steps": cfg.train.steps,
        "replicas_finished": len({s["replica"] for s in summaries.values()}),
        final: first[final] if first else None,
        f"{final}_by_replica": {name: s.get(final) for name, s in summaries.items()},
        "restarts": len([e for e in events if e["event"] == "replica_restarted"]),
        "failures": [{k: f[k] for k in ("replica", "stage", "how", "wall_s")} for f in failed],
        "steps_redone": len({e["step"] for e in events if e["event"] == "rolled_back"}),
        "replica_steps_missed": missed, "rejoins": rejoins,
        "quorum_changes": [{k: q[k] for k in ("step", "members", "left", "joined")} for q in quorum],
        "replica_summaries": summaries, "model": model.name if model is not None else None,
        "model_format": None if model is None else  # as engine/job_model.py: model_summary says it
        "peft" if cfg.train.lora.rank and cfg.train.lora.save == "adapter" else "transformers",
        **code_stamp(),  # the launcher's code (each replica's summary carries its own)
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    resolved = next((p / "config.toml" for p in folders if (p / "config.toml").is_file()), None)
    (out / "config.toml").write_text(resolved.read_text() if resolved else cfg.to_toml())
    return summary


def _folder_order(p: Path) -> tuple[int, int]:
    name = p.name.removeprefix("replica")
    r, _, n = name.partition("-restart")
    return int(r), -int(n or 0)
