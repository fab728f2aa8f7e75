"""DPO and GSPO on real processes (torchrun, gloo) == the simulation, bitwise: rollouts generated on the mesh,
rewards, old log-probs, every update and its metrics; and a crashed GSPO job resumes to the same run."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import WALL_CLOCK, assert_same_model, assert_same_model_folder
from tests.integration.test_dist import launch
from tests.integration.test_post_sft_train import as_args, dpo_sets, gspo_sets, pairs_file, prompts_file
from thinpipe.cli import main

DROP = (*WALL_CLOCK, "gen_tokens_per_s")  # measured, not computed (slowest_rank / slowest_link: where time went)


def same(folder_a, folder_b):
    a = [json.loads(x) for x in (folder_a / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (folder_b / "metrics.jsonl").read_text().splitlines()]
    sa, sb = (json.loads((f / "summary.json").read_text()) for f in (folder_a, folder_b))
    strip = lambda d: {k: v for k, v in d.items() if k not in DROP and "wall" not in k}  # noqa: E731
    return [strip(r) for r in a] == [strip(r) for r in b] and strip(sa) == strip(sb)


CASES = {
    "gspo: mask + PowerSGD, 2 x 2, rollouts through the training boundaries": (
        4, lambda p: gspo_sets(prompts_file(p), **{"mesh.dp": 2, "boundary.kind": "mask", "boundary.p": 0.5,
                                                   "dp.kind": "powersgd", "rl.rollout_boundaries": "train",
                                                   "rl.minibatches": 2, "train.steps": 3, "eval.every": 2})),
    "gspo: MAPL, 3 stages, token-level ratio": (
        3, lambda p: gspo_sets(prompts_file(p), **{"mesh.pp": 3, "boundary.kind": "mapl", "boundary.rank": 8,
                                                   "rl.ratio_level": "token", "rl.minibatches": 2})),
    "dpo: mask, 2 x 2": (4, lambda p: dpo_sets(pairs_file(p), **{"mesh.dp": 2, "boundary.kind": "mask",
                                                                  "boundary.p": 0.5, "eval.every": 2})),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_dist_equals_sim_after_sft(case, tmp_path, one_thread):  # noqa: F811
    nproc, make = CASES[case]
    args = as_args(make(tmp_path))
    assert main(["train", "--out", str(tmp_path / "sim"), "--quiet", *args]) == 0
    r = launch(nproc, tmp_path / "dist", args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert same(tmp_path / "sim", tmp_path / "dist")
    if case.startswith("gspo: mask"):  # a full fine-tune's model read back from the ranks' parts (issue 50)
        assert_same_model(tmp_path / "dist", tmp_path / "sim")
        assert_same_model_folder(tmp_path / "dist" / "model", tmp_path / "sim" / "model")  # and written at its end


ANCHOR_CASES = {
    "gspo": lambda p: gspo_sets(prompts_file(p), **{"boundary.kind": "mask", "boundary.p": 0.9, "mesh.anchor": 1,
                                                     "anchor.staleness": 1, "anchor.push_rank": 2, "train.steps": 3,
                                                     "rl.kl_beta": 0.05}),  # reference log-probs travel too
    "dpo": lambda p: dpo_sets(pairs_file(p), **{"boundary.kind": "mask", "boundary.p": 0.9, "mesh.anchor": 1,
                                                 "anchor.staleness": 1, "train.steps": 3}),
}


@pytest.mark.dist
@pytest.mark.parametrize("objective", list(ANCHOR_CASES))
def test_an_objective_with_the_anchor_circuit_on_real_processes_equals_the_simulation(objective, tmp_path,
                                                                                      one_thread):  # noqa: F811
    """The anchor row's processes train on replica 0's rows of each update, carried with the pulls: every row's
    loss and gradient norm and the summary's totals (anchor bytes, priors consumed) equal the simulation's. A
    row's anchor_bytes is asynchronous on real processes (the anchor's own traffic is counted at the end)."""
    args = as_args(ANCHOR_CASES[objective](tmp_path))
    assert main(["train", "--out", str(tmp_path / "sim"), "--quiet", *args]) == 0
    r = launch(4, tmp_path / "dist", args)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = ([{k: v for k, v in json.loads(x).items() if k not in (*DROP, "anchor_bytes")}
             for x in (f / "metrics.jsonl").read_text().splitlines()] for f in (tmp_path / "sim", tmp_path / "dist"))
    assert a == b
    sa, sb = (json.loads((f / "summary.json").read_text()) for f in (tmp_path / "sim", tmp_path / "dist"))
    final = "final_val_accuracy" if objective == "gspo" else "final_val_loss"
    keys = ("anchor_bytes", "priors_consumed", "anchor_staleness_mean", final)
    assert {k: sa[k] for k in keys} == {k: sb[k] for k in keys} and sa["priors_consumed"] == 2


@pytest.mark.dist
@pytest.mark.parametrize("objective", ["gspo", "dpo"])
def test_a_crashed_job_resumes_to_the_same_run(tmp_path, objective):
    """Data position, rollout seeds and (DPO) the reference log-probs come back from the per-rank parts."""
    make, sets = (prompts_file, gspo_sets) if objective == "gspo" else (pairs_file, dpo_sets)
    args = as_args(sets(make(tmp_path), **{"mesh.dp": 2, "boundary.kind": "mask", "boundary.p": 0.5,
                                           "train.steps": 4, "train.checkpoint_every": 2}))
    full, part = tmp_path / "full", tmp_path / "part"
    assert launch(4, full, args).returncode == 0
    crashed = launch(4, part, args, THINPIPE_FAULT_AT_STEP="3")
    assert crashed.returncode != 0 and "injected fault at step 3" in crashed.stderr
    r = launch(4, part, args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert same(full, part)


@pytest.mark.dist
def test_a_diverged_gspo_run_rolls_back_on_real_processes_as_in_the_simulation(tmp_path, one_thread):  # noqa: F811
    """train.on_divergence = rollback under --engine dist: a NaN loss at step 3 sends the ranks back to step 2's
    checkpoint with train.lr halved, the run finishes, and every row and the summary equal the simulation's."""
    args = as_args(gspo_sets(prompts_file(tmp_path), **{"boundary.kind": "mask", "boundary.p": 0.5, "train.steps": 5,
                                                        "train.checkpoint_every": 2,
                                                        "train.on_divergence": "rollback"}))
    env = {"THINPIPE_TEST_NAN_AT_STEP": "3"}
    sim = subprocess.run([sys.executable, "-m", "thinpipe", "train", "--out", str(tmp_path / "sim"), "--quiet", *args],
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stderr[-3000:]
    r = launch(2, tmp_path / "dist", args, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rolled back to the checkpoint of step 2" in r.stderr
    assert same(tmp_path / "sim", tmp_path / "dist")
    summary = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert summary["rollbacks"] == 1 and summary["steps"] == 5
    got = [json.loads(x) for x in (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in got] == list(range(5)) and got[3]["lr"] < got[1]["lr"]


@pytest.mark.dist
def test_a_diverged_anchor_run_rolls_back_on_real_processes_as_in_the_simulation(tmp_path, one_thread):  # noqa: F811
    """SFT with the anchor circuit, a NaN loss at step 5: the fast ranks and the anchor row go back to step 4's
    checkpoint together (pushes of the diverged trajectory are dropped, the anchor reloads its part), and every
    row's loss, the held-out losses and the anchor totals equal the simulation's."""
    args = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "mesh.pp=2",
            "--set", "train.batch_size=2", "--set", "train.seq_len=32", "--set", "train.microbatches=2",
            "--set", "train.steps=8", "--set", "train.checkpoint_every=2", "--set", "train.on_divergence=rollback",
            "--set", "boundary.kind=mask", "--set", "boundary.p=0.9", "--set", "mesh.anchor=1",
            "--set", "anchor.staleness=2", "--set", "anchor.push_rank=2", "--set", "eval.every=3"]
    env = {"THINPIPE_TEST_NAN_AT_STEP": "5"}
    sim = subprocess.run([sys.executable, "-m", "thinpipe", "train", "--out", str(tmp_path / "sim"), "--quiet", *args],
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stderr[-3000:]
    r = launch(4, tmp_path / "dist", args, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rolled back to the checkpoint of step 4" in r.stderr
    a, b = ([{k: v for k, v in json.loads(x).items() if k not in (*DROP, "anchor_bytes")}
             for x in (f / "metrics.jsonl").read_text().splitlines()] for f in (tmp_path / "sim", tmp_path / "dist"))
    assert a == b and [m["step"] for m in b] == list(range(8))
    sa, sb = (json.loads((f / "summary.json").read_text()) for f in (tmp_path / "sim", tmp_path / "dist"))
    keys = ("anchor_bytes", "priors_consumed", "final_val_loss", "val_points", "rollbacks")
    assert {k: sa[k] for k in keys} == {k: sb[k] for k in keys} and sb["rollbacks"] == 1
