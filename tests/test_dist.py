"""Real processes (torchrun, gloo) == the single-process simulation: losses, held-out loss, bytes.

Each case trains a tiny model both ways with identical arguments; the distributed run's per-step
training loss, final held-out loss and metered bytes per axis must equal the simulation's bitwise
(same operations in the same order on every rank)."""

import json
import os
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


def results(folder):
    s = json.loads((folder / "summary.json").read_text())
    losses = [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return losses, s["final_val_loss"], {k: v for k, v in s.items() if k.endswith("_bytes")}


@pytest.mark.parametrize("case", list(CASES))
def test_dist_equals_sim(case, tmp_path):
    nproc, args = CASES[case]
    sim, dist_out = tmp_path / "sim", tmp_path / "dist"
    assert main(["train", "--out", str(sim), "--quiet", *BASE, *args]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "thinpipe", "launch", "--nproc", str(nproc), "--", "train", "--out",
                        str(dist_out), "--quiet", *BASE, *args], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(dist_out) == results(sim)
    assert len(list((dist_out / "checkpoint").glob("rank*.pt"))) == nproc


def test_wrong_process_count_is_a_clear_error(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "thinpipe", "launch", "--nproc", "3", "--", "train", "--out",
                        str(tmp_path / "x"), "--quiet", *BASE, *CASES["mask + PowerSGD, 2 replicas x 2 stages"][1]],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "needs 4 processes, but 3 were started" in r.stderr
