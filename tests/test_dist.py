"""Real processes (torchrun, gloo) == the single-process simulation: losses, held-out loss, bytes.

Each case trains a tiny model both ways with identical arguments; the distributed run's per-step
training loss, final held-out loss and metered bytes per axis must equal the simulation's bitwise
(same operations in the same order on every rank)."""

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest

from thinpipe.cli import main

BASE = ["--set", "data.name=synthetic", "--set", "train.steps=3", "--set", "train.batch_size=2",
        "--set", "train.seq_len=32", "--set", "train.microbatches=2", "--set", "train.lr=1e-3",
        "--set", "train.checkpoint_every=0"]
CASES = {
    "mask + PowerSGD, 2 replicas x 2 stages": (4, ["--set", "model.name=tiny-llama", "--set", "mesh.pp=2",
                                                   "--set", "mesh.dp=2", "--set", "boundary.kind=mask",
                                                   "--set", "dp.kind=powersgd", "--set", "dp.start_step=1"]),
    "MAPL-VQ, 3 stages": (3, ["--set", "model.name=tiny-llama", "--set", "mesh.pp=3", "--set", "boundary.kind=mapl-vq",
                              "--set", "boundary.rank=16", "--set", "boundary.vq_codes=32",
                              "--set", "boundary.vq_sync_codes=4"]),
    "tied Qwen2 + Streaming DiLoCo in flight, GPipe": (4, ["--set", "model.name=tiny-qwen2", "--set", "mesh.pp=2",
                                                           "--set", "mesh.dp=2", "--set", "dp.kind=streaming-diloco",
                                                           "--set", "dp.inner_steps=2", "--set", "dp.fragments=2",
                                                           "--set", "dp.overlap=1", "--set", "train.steps=5",
                                                           "--set", "train.schedule=gpipe"]),
}


def launch(nproc: int, out, args: list[str], *extra: str, **env_extra: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run([sys.executable, "-m", "thinpipe", "launch", "--nproc", str(nproc), "--", "train",
                           "--out", str(out), "--quiet", *args, *extra], env=env, capture_output=True, text=True,
                          timeout=300)


def results(folder):
    s = json.loads((folder / "summary.json").read_text())
    losses = [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return losses, s["final_val_loss"], {k: v for k, v in s.items() if k.endswith("_bytes")}


@pytest.mark.parametrize("case", list(CASES))
def test_dist_equals_sim(case, tmp_path):
    nproc, args = CASES[case]
    sim, dist_out = tmp_path / "sim", tmp_path / "dist"
    assert main(["train", "--out", str(sim), "--quiet", *BASE, *args]) == 0
    r = launch(nproc, dist_out, [*BASE, *args])
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(dist_out) == results(sim)
    assert len(list((dist_out / "checkpoint").glob("step*/rank*.pt"))) == nproc


def test_wrong_process_count_is_a_clear_error(tmp_path):
    r = launch(3, tmp_path / "x", [*BASE, *CASES["mask + PowerSGD, 2 replicas x 2 stages"][1]])
    assert r.returncode != 0 and "needs 4 processes, but 3 were started" in r.stderr


def test_a_dead_stage_rank_stops_every_rank_quickly_and_is_named(tmp_path):
    """kill -9 one rank mid-run: every process is gone well within 60 s, and the output names the
    dead rank (torchrun's root cause) and its role (each rank's start-up line)."""
    import signal
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "thinpipe", "launch", "--nproc", "4", "--", "train", "--out", str(tmp_path / "f"),
            *BASE, *CASES["mask + PowerSGD, 2 replicas x 2 stages"][1], "--set", "train.steps=100000"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = []
    try:
        while True:  # wait until every rank has started training (its role line is printed)
            line = proc.stdout.readline()
            out.append(line)
            if sum("[thinpipe rank" in x for x in out) == 4 or not line:
                break
        time.sleep(3)
        victims = subprocess.run(["pgrep", "-f", f"thinpipe train --out {tmp_path / 'f'}"], capture_output=True,
                                 text=True).stdout.split()
        ranks = [int(v) for v in victims if int(v) != proc.pid
                 and b"torch.distributed.run" not in Path(f"/proc/{v}/cmdline").read_bytes()]
        assert len(ranks) >= 4
        t0 = time.time()
        os.kill(max(ranks), signal.SIGKILL)
        rest, _ = proc.communicate(timeout=60)
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(out) + rest
    assert proc.returncode != 0 and elapsed < 60
    assert "Root Cause" in text and "SIGKILL" in text
    assert "stage 1" in text and "fast replica" in text


@pytest.mark.parametrize("case", ["tied Qwen2 + Streaming DiLoCo in flight, GPipe", "MAPL-VQ, 3 stages"])
def test_crash_and_resume_from_per_rank_checkpoints_continues_the_same_run(case, tmp_path):
    nproc, args = CASES[case]
    args = [*BASE, *args, "--set", "train.steps=6", "--set", "train.checkpoint_every=3"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert launch(nproc, full, args).returncode == 0
    crashed = launch(nproc, part, args, THINPIPE_FAULT_AT_STEP="4")
    assert crashed.returncode != 0 and "injected fault at step 4" in crashed.stderr
    r = launch(nproc, part, args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(part) == results(full)


def test_a_crash_while_checkpointing_resumes_from_the_previous_complete_checkpoint(tmp_path):
    nproc, args = CASES["mask + PowerSGD, 2 replicas x 2 stages"]
    args = [*BASE, *args, "--set", "train.steps=6", "--set", "train.checkpoint_every=2"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert launch(nproc, full, args).returncode == 0
    crashed = launch(nproc, part, args, THINPIPE_FAULT_AT_CHECKPOINT="4")  # the last rank dies after writing step 4
    assert crashed.returncode != 0
    assert json.loads((part / "checkpoint" / "latest.json").read_text())["step"] == 2
    r = launch(nproc, part, args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(part) == results(full)
