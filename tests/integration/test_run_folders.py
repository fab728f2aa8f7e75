"""Issue 25 point 2: no command deletes what it did not create, and one job per run folder.

Each deleting case is refused (exit 2, one line) and its victim folder is byte-for-byte unchanged:
``export --out`` the run, inside it, containing it, or any folder that is not an earlier export;
``train --init-from`` one inside the other with ``--out``, or unreadable while ``--overwrite`` would
remove ``--out``; ``--overwrite`` on a folder thinpipe did not write; a second process on a folder
whose lock is held (docs/reliability.md, "One job per folder").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from thinpipe.checkpoint import sets
from thinpipe.cli import main
from thinpipe.config import ConfigError
from thinpipe.engine.run_folder import EXPORT_MARKER
from thinpipe.jsonl import read_rows
from thinpipe.runlock import HELD_ENV, LOCK_FILE, holder, is_held, take_run_lock

TINY = ["--quiet", "--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "train.batch_size=2",
        "--set", "train.seq_len=32", "--set", "train.lr=1e-3", "--set", "mesh.pp=2", "--set", "train.steps=4",
        "--set", "train.checkpoint_every=2"]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones included) with its SHA-256: "unchanged" means equal snapshots."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One tiny finished run (4 steps, checkpoints at 2 and 4), copied by the tests that change it."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", "--out", str(out), *TINY]) == 0
    return out


def copy_run(trained: Path, where: Path) -> Path:
    where.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(trained, where)
    return where


def project(folder: Path) -> Path:
    """A user's folder that happens to use the names a run has."""
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "weights.bin").write_bytes(b"\x00\x01 mine")
    (folder / "config.toml").write_text('[project]\nname = "mine"\n')
    (folder / "notes.md").write_text("my notes\n")
    return folder


# ----------------------------------------------------------------------------------------- export

def test_export_into_the_run_inside_it_or_around_it_is_refused_and_nothing_changes(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "runs" / "r")
    (tmp_path / "runs" / "other.txt").write_text("a sibling of the run\n")
    before = snapshot(tmp_path)
    for out, says in [(run, "are the same folder"), (run / "checkpoint", "lies inside"), (run / "new", "lies inside"),
                      (tmp_path / "runs", "lies inside"), (tmp_path, "lies inside")]:
        for extra in ([], ["--overwrite"]):
            assert main(["export", "--run", str(run), "--out", str(out), *extra]) == 2, out
            err = capsys.readouterr().err
            assert says in err and err.count("\n") == 1, err
    assert snapshot(tmp_path) == before


def test_export_into_a_folder_that_is_no_export_is_refused_and_nothing_changes(trained, tmp_path, capsys):
    mine = project(tmp_path / "project")
    before = snapshot(mine)
    for extra in ([], ["--overwrite"]):
        assert main(["export", "--run", str(trained), "--out", str(mine), *extra]) == 2
        assert f"is no export of thinpipe's (no {EXPORT_MARKER})" in capsys.readouterr().err
    assert snapshot(mine) == before


def test_export_replaces_an_earlier_export_only_with_overwrite_and_only_its_own_files(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    hf = tmp_path / "hf"
    assert main(["export", "--run", str(trained), "--out", str(hf)]) == 0
    marker = json.loads((hf / EXPORT_MARKER).read_text())
    assert set(marker["files"]) | {EXPORT_MARKER} == set(snapshot(hf)) and "model.safetensors" in marker["files"]
    first = snapshot(hf)
    assert main(["export", "--run", str(trained), "--out", str(hf)]) == 2  # an export, but no --overwrite
    assert "holds an earlier export: add --overwrite" in capsys.readouterr().err
    assert snapshot(hf) == first
    assert main(["export", "--run", str(trained), "--out", str(hf), "--overwrite"]) == 0
    assert set(snapshot(hf)) == set(first)
    AutoModelForCausalLM.from_pretrained(hf)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left behind
    (hf / "my-eval.json").write_text("{}")  # a file the user added: the folder is no longer only the export
    before = snapshot(hf)
    assert main(["export", "--run", str(trained), "--out", str(hf), "--overwrite"]) == 2
    assert "holds files the earlier export did not write (my-eval.json)" in capsys.readouterr().err
    assert snapshot(hf) == before


def test_a_forged_export_marker_cannot_make_overwrite_remove_files_outside_the_folder(trained, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("not thinpipe's\n")
    out = tmp_path / "hf"
    out.mkdir()
    (out / EXPORT_MARKER).write_text(json.dumps({"files": ["../victim.txt", str(victim)]}))
    assert main(["export", "--run", str(trained), "--out", str(out), "--overwrite"]) == 0
    assert victim.read_text() == "not thinpipe's\n"
    assert (out / "model.safetensors").is_file()


def test_out_that_is_a_file_or_under_one_is_one_line_for_train_export_and_launch(trained, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    for out, says in [(f, "is a file, not a folder"), (f / "sub", "which is a file")]:
        for argv in (["train", "--out", str(out), *TINY], ["export", "--run", str(trained), "--out", str(out)],
                     ["launch", "--nproc", "2", "--", "train", "--out", str(out), *TINY]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert says in err and err.count("\n") == 1, err
    assert f.read_text() == "x"


# ------------------------------------------------------------------------------------------ train

def test_init_from_and_out_one_inside_the_other_is_refused_and_nothing_is_removed(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "runs" / "r")
    before = snapshot(tmp_path)
    for out, src, extra in [(run, run, ["--overwrite"]), (run / "phase2", run, []), (tmp_path / "runs", run, []),
                            (run, run / "checkpoint", ["--overwrite"])]:
        assert main(["train", "--out", str(out), "--init-from", str(src), *extra, *TINY]) == 2, (out, src)
        err = capsys.readouterr().err
        assert ("are the same folder" in err or "lies inside" in err) and err.count("\n") == 1, err
    assert snapshot(tmp_path) == before


def test_init_from_is_read_before_overwrite_removes_the_old_run(trained, tmp_path, capsys):
    old = copy_run(trained, tmp_path / "old")
    broken = tmp_path / "broken"  # a run folder whose checkpoint is gone: reading it fails
    broken.mkdir()
    shutil.copy(trained / "config.toml", broken / "config.toml")
    before = snapshot(old)
    assert main(["train", "--out", str(old), "--overwrite", "--init-from", str(broken), *TINY]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert snapshot(old) == before


def test_overwrite_removes_nothing_from_a_folder_thinpipe_did_not_write(tmp_path, capsys):
    mine = project(tmp_path / "project")
    before = snapshot(mine)
    assert main(["train", "--out", str(mine), "--overwrite", *TINY]) == 2
    assert "but no thinpipe run" in capsys.readouterr().err
    assert snapshot(mine) == before
    # a rank of `thinpipe launch ... --overwrite`: its launcher has just put its lock file in the folder
    with take_run_lock(mine, job=True):
        assert main(["train", "--out", str(mine), "--overwrite", *TINY]) == 2
    assert "but no thinpipe run" in capsys.readouterr().err
    assert {k: v for k, v in snapshot(mine).items() if k != LOCK_FILE} == before


def test_a_held_folder_refuses_a_second_job_with_or_without_overwrite_or_resume(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "run")
    fresh = tmp_path / "fresh"
    held = [take_run_lock(run), take_run_lock(fresh)]  # another open file: flock refuses this process too
    try:
        before = snapshot(tmp_path)
        for argv in (["--out", str(fresh)], ["--out", str(run), "--overwrite"], ["--out", str(run), "--resume"]):
            assert main(["train", *argv, *TINY]) == 2, argv
            err = capsys.readouterr().err
            assert f"is in use by another thinpipe job (pid {os.getpid()} on " in err and err.count("\n") == 1, err
        assert snapshot(tmp_path) == before
    finally:
        for lock in held:
            lock.release()
    assert not is_held(run / LOCK_FILE)


def test_a_launchers_lock_lets_its_own_processes_in_only_while_it_is_held(tmp_path, monkeypatch):
    out = tmp_path / "job"
    monkeypatch.delenv(HELD_ENV, raising=False)
    job = take_run_lock(out, job=True)
    assert os.environ[HELD_ENV] == str((out / LOCK_FILE).resolve()) and is_held(out / LOCK_FILE)
    rank = take_run_lock(out)  # a child of the launcher: named in the variable and really held
    assert rank.fd is None
    with pytest.raises(ConfigError, match="in use by another thinpipe job"):
        _other_folder_refused(out, monkeypatch)
    job.release()
    assert HELD_ENV not in os.environ and not is_held(out / LOCK_FILE)
    # a variable left behind (its launcher gone) admits nobody: the lock is taken for real, then refuses others
    monkeypatch.setenv(HELD_ENV, str((out / LOCK_FILE).resolve()))
    mine = take_run_lock(out)
    try:
        assert mine.fd is not None and is_held(out / LOCK_FILE)
        monkeypatch.delenv(HELD_ENV)
        with pytest.raises(ConfigError, match=f"pid {os.getpid()} on "):
            take_run_lock(out)
    finally:
        mine.release()


def _other_folder_refused(out: Path, monkeypatch) -> None:
    """Without the variable naming the folder, the launcher's lock refuses like any other holder's."""
    with monkeypatch.context() as m:
        m.delenv(HELD_ENV)
        take_run_lock(out)


# ------------------------------------------------------------------------------ metrics.jsonl cut off

@pytest.mark.slow  # ~10 s: a resumed run
def test_resume_drops_a_cut_off_last_metrics_line_with_one_warning_and_continues(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "run")
    whole = [r["loss"] for r in read_rows(trained / "metrics.jsonl")]
    shutil.rmtree(sets(run / "checkpoint")[0][1])  # killed after step 3's row began: the newest set is step 2's
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text[:len(text) - len(text.splitlines()[-1]) // 2 - 1])  # half a row, no \n
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", *TINY]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "cut-off line" in line]
    assert len(warnings) == 1 and "metrics.jsonl ends in a cut-off line 4" in warnings[0], warnings
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == whole  # every line parses; the run is the same run


def test_compare_reads_a_run_whose_last_metrics_line_is_cut_off(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1.2')
    assert main(["compare", str(run), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["runs"][0]["finished"] and "cut-off line 5" in out.err


def test_a_damaged_metrics_line_before_the_last_is_one_line_not_a_traceback(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(ConfigError, match="line 2 is not a JSON row"):
        read_rows(path)
    path.write_text('{"step": 0}\n{"step": 1}\n[1, 2')
    assert read_rows(path, warn=None) == [{"step": 0}, {"step": 1}]


# ------------------------------------------------------------------------------------ elastic job

def test_an_elastic_jobs_overwrite_removes_its_own_files_only_and_holds_the_lock(tmp_path, monkeypatch):
    pytest.importorskip("torchft")
    from thinpipe.commands.launch_elastic import claim_job

    monkeypatch.delenv(HELD_ENV, raising=False)
    job = tmp_path / "job"
    for name in ("replica0", "replica1-restart2"):
        (job / name).mkdir(parents=True)
        (job / name / "metrics.jsonl").write_text("")
    (job / "events.jsonl").write_text("")
    (job / "replica_notes.txt").write_text("mine\n")
    (job / "replicas").mkdir()
    lock = claim_job(job, overwrite=True)
    try:
        assert sorted(p.name for p in job.iterdir()) == [LOCK_FILE, "replica_notes.txt", "replicas"]
        assert is_held(job / LOCK_FILE) and os.environ[HELD_ENV] == str((job / LOCK_FILE).resolve())
        assert f"pid {os.getpid()}" in holder(job / LOCK_FILE)
    finally:
        lock.release()
    mine = project(tmp_path / "project")
    (mine / "summary.json").write_text("{}")
    before = snapshot(mine)
    with pytest.raises(ConfigError, match="but no thinpipe job"):
        claim_job(mine, overwrite=True)
    assert snapshot(mine) == before


# ----------------------------------------------------------------------------------- real processes

def _wait(what, timeout_s: float = 240.0, proc: subprocess.Popen | None = None):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if what():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError("timed out")


@pytest.mark.slow
def test_a_second_process_is_refused_while_the_first_lives_and_takes_over_once_it_is_sigkilled(tmp_path, capsys):
    out = tmp_path / "run"
    long = [a if a != "train.steps=4" else "train.steps=100000" for a in TINY]
    first = subprocess.Popen([sys.executable, "-m", "thinpipe", "train", "--out", str(out), *long],
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: is_held(out / LOCK_FILE) and (out / "metrics.jsonl").is_file()
              and len(read_rows(out / "metrics.jsonl", warn=None)) >= 3, proc=first)
        assert f"pid {first.pid} on " in holder(out / LOCK_FILE)
        for extra in (["--overwrite"], ["--resume"]):
            assert main(["train", "--out", str(out), *extra, *TINY]) == 2
            err = capsys.readouterr().err
            assert f"is in use by another thinpipe job (pid {first.pid} on " in err, err
        steps = [r["step"] for r in read_rows(out / "metrics.jsonl", warn=None)]
        assert steps == list(range(len(steps)))  # only the first process's rows, in order
        assert first.poll() is None  # refused while the first lives
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert not is_held(out / LOCK_FILE)  # the kernel gave the dead holder's lock back
    assert main(["train", "--out", str(out), "--overwrite", *TINY]) == 0  # a stale lock is taken over
    assert [r["step"] for r in read_rows(out / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.dist
def test_the_launcher_holds_the_lock_and_its_ranks_are_not_refused(tmp_path):
    out = tmp_path / "job"
    launcher = subprocess.Popen([sys.executable, "-m", "thinpipe", "launch", "--nproc", "2", "--", "train", "--out",
                                 str(out), *TINY], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, err[-3000:]
    assert (out / "summary.json").is_file() and "in use by another" not in err
    assert f"pid {launcher.pid} on " in holder(out / LOCK_FILE)  # the launcher took it; rank 0 did not


def test_an_elastic_jobs_events_survive_a_cut_off_last_line(tmp_path, capsys):
    """A replica killed mid-append leaves a cut-off last line in events.jsonl: the job's readers drop it
    with one warning (the summary is built from the rest)."""
    from thinpipe.events import append_event, read_events

    append_event(tmp_path, "replica_started", replica=0)
    append_event(tmp_path, "quorum", members=[0, 1])
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"event": "replica_fai')
    assert [e["event"] for e in read_events(tmp_path)] == ["replica_started", "quorum"]
    assert "ends in a cut-off line 3" in capsys.readouterr().err
