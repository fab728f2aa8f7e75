"""Issue 16's findings, each reproduced: a re-run never destroys a run, divergence never overwrites
the last good checkpoint and exits 3, a crash during a checkpoint write leaves a resumable run, and
no command runs code from a run folder."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from thinpipe.checkpoint import latest_complete, load_part, sets
from thinpipe.cli import main

pytestmark = pytest.mark.slow  # whole training runs (~1.5 min together): make test, not make test-fast

TINY = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "train.batch_size=2",
        "--set", "train.seq_len=32", "--set", "train.lr=1e-3", "--set", "train.steps=4", "--set", "mesh.pp=2"]


def rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_second_train_into_a_run_folder_is_refused_unless_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "r1"
    assert main(["train", "--out", str(out), "--quiet", *TINY]) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--quiet", *TINY, "--set", "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds a run" in err and "--resume" in err and "--overwrite" in err
    assert (out / "metrics.jsonl").read_text() == before            # nothing touched
    assert main(["train", "--out", str(out), "--quiet", "--overwrite", *TINY, "--set", "train.steps=2"]) == 0
    assert len(rows(out)) == 2 and [s for s, _ in sets(out / "checkpoint")] == [2]
    assert main(["train", "--out", str(out), "--resume", "--overwrite", *TINY]) == 2


def finite(state) -> bool:
    return all(bool(torch.isfinite(t).all()) for row in state["mesh"]["ranks"] for rank in row
               for t in rank["stage"].values() if t.is_floating_point())


def test_the_issues_divergence_ends_in_one_line_exit_3_and_no_diverged_checkpoint(tmp_path, capsys):
    out = tmp_path / "d"
    code = main(["train", "--out", str(out), "--quiet", *TINY, "--set", "train.lr=1e38", "--set", "train.steps=8",
                 "--set", "train.checkpoint_every=2"])
    err = capsys.readouterr().err.strip()
    assert code == 3 and err.count("\n") == 0 and "diverged at step" in err and "lower train.lr" in err, err
    for _, folder in sets(out / "checkpoint"):
        assert finite(load_part(folder, "mesh"))


def test_divergence_keeps_the_last_good_checkpoint_and_names_it(tmp_path, capsys, monkeypatch):
    """Weights poisoned by step 3's update: steps 1-3's checkpoints stay, the newest (3) is finite,
    and the one line says to resume from it."""
    from thinpipe.engine.sim_mesh import SimMesh

    real = SimMesh.update

    def poisoned(self, index, lr, ctxs, source=None):
        loss = real(self, index, lr, ctxs, source)
        if index == 3:  # step 3's update
            with torch.no_grad():
                next(self.replicas[0][1].parameters()).fill_(float("nan"))
        return loss

    monkeypatch.setattr(SimMesh, "update", poisoned)
    out = tmp_path / "d"
    code = main(["train", "--out", str(out), "--quiet", *TINY, "--set", "train.steps=8",
                 "--set", "train.checkpoint_every=1", "--set", "train.keep_checkpoints=3"])
    err = capsys.readouterr().err.strip()
    assert code == 3 and err.count("\n") == 0, err
    assert "diverged at step 3" in err and "last good checkpoint is step 3" in err
    assert [s for s, _ in sets(out / "checkpoint")] == [3, 2, 1]
    step, state = latest_complete(out / "checkpoint", "mesh")
    assert step == 3 and finite(state)
    assert len(rows(out)) == 4   # steps 0-3: the metrics of the step that diverged are kept


def test_a_crash_while_writing_a_checkpoint_leaves_a_resumable_run(tmp_path, monkeypatch):
    """kill -9 in the middle of a write, done by a child process killed with SIGKILL while it writes."""
    out = tmp_path / "k"
    args = [*TINY, "--set", "train.steps=6", "--set", "train.checkpoint_every=2"]
    env = {**os.environ, "THINPIPE_TEST_KILL_IN_CHECKPOINT_WRITE": "4"}
    child = subprocess.run([sys.executable, "-m", "thinpipe", "train", "--out", str(out), "--quiet", *args], env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr[-2000:]
    assert latest_complete(out / "checkpoint", "mesh")[0] == 2          # step 4's set is half written
    assert main(["train", "--out", str(out), "--quiet", "--resume", *args]) == 0
    whole = tmp_path / "w"
    assert main(["train", "--out", str(whole), "--quiet", *args]) == 0
    assert [r["loss"] for r in rows(out)] == [r["loss"] for r in rows(whole)]


class _Touch:
    """Unpickling this runs ``touch`` (what a malicious run folder would do)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("command", ["export", "eval", "prune", "analyze", "resume"])
def test_a_crafted_pickle_in_a_run_folder_never_runs(tmp_path, command, capsys):
    run = tmp_path / "shared_run"
    assert main(["train", "--out", str(run), "--quiet", *TINY, "--set", "train.steps=1"]) == 0
    for _, folder in sets(run / "checkpoint"):   # what an older thinpipe, or an attacker, leaves
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    marker = tmp_path / "pwned"
    (run / "checkpoint" / "state.pt").write_bytes(pickle.dumps({"mesh": _Touch(marker)}))
    argv = {"export": ["export", "--run", str(run), "--out", str(tmp_path / "hf")],
            "eval": ["eval", "--model", str(run), "--tasks", "arc_easy", "--limit", "1"],
            "prune": ["prune", "--run", str(run), "--sparsity", "0.1"],
            "analyze": ["analyze", "--run", str(run)],
            "resume": ["train", "--out", str(run), "--quiet", "--resume", *TINY, "--set", "train.steps=1"]}[command]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pickle" in err and "state.pt" in err
    assert not marker.exists()


def test_resume_from_a_truncated_checkpoint_is_one_line(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["train", "--out", str(out), "--quiet", *TINY, "--set", "train.steps=2"]) == 0
    (_, folder), = sets(out / "checkpoint")
    st = folder / "mesh.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--quiet", "--resume", *TINY, "--set", "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "mesh.safetensors does not match its SHA-256" in err[-1] and "Traceback" not in "\n".join(err)


def test_rollback_reloads_the_last_good_checkpoint_with_a_lower_lr_and_finishes(tmp_path, capsys, monkeypatch):
    """``train.on_divergence = rollback``: a NaN loss at step 5 sends the run back to step 4's
    checkpoint with train.lr halved; steps 0-3 are the uninterrupted run's, the rows are unique and
    the lowered lr is what config.toml records (a --resume keeps it)."""
    from thinpipe.config import load_config

    args = [*TINY, "--set", "train.steps=8", "--set", "train.checkpoint_every=2"]
    plain, rolled = tmp_path / "plain", tmp_path / "rolled"
    assert main(["train", "--out", str(plain), "--quiet", *args]) == 0
    monkeypatch.setenv("THINPIPE_TEST_NAN_AT_STEP", "5")
    capsys.readouterr()
    assert main(["train", "--out", str(rolled), "--quiet", *args, "--set", "train.on_divergence=rollback"]) == 0
    err = capsys.readouterr().err
    assert "diverged at step 5" in err and "rolled back to the checkpoint of step 4 with train.lr = 0.0005" in err
    a, b = rows(plain), rows(rolled)
    assert [m["step"] for m in b] == list(range(8))
    assert [m["loss"] for m in b[:4]] == [m["loss"] for m in a[:4]]
    assert [m["lr"] for m in b[4:]] == pytest.approx([m["lr"] / 2 for m in a[4:]], rel=1e-12)
    assert b[4]["loss"] == a[4]["loss"]  # step 4 starts from the same weights; its update is smaller
    assert b[5]["loss"] != a[5]["loss"]
    assert load_config(rolled / "config.toml").train.lr == 5e-4
    assert json.loads((rolled / "summary.json").read_text())["steps"] == 8


def test_rollback_without_a_checkpoint_or_past_its_limit_stops_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("THINPIPE_TEST_NAN_AT_STEP", "1")
    out = tmp_path / "r"
    assert main(["train", "--out", str(out), "--quiet", *TINY, "--set", "train.checkpoint_every=2",
                 "--set", "train.on_divergence=rollback"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "diverged at step 1" in err and "no checkpoint was written before it" in err
    monkeypatch.setenv("THINPIPE_TEST_NAN_AT_STEP", "3")
    assert main(["train", "--out", str(out), "--quiet", "--overwrite", *TINY, "--set", "train.checkpoint_every=2",
                 "--set", "train.on_divergence=rollback", "--set", "train.max_rollbacks=0"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "last good checkpoint is step 2" in err
