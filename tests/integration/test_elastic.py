"""Elastic replicas on torchft (engine/elastic_rank.py, launch_elastic.py, comm/managed.py, comm/recovery.py).

Multi-process cases (marked ``dist``): with no failure every replica's files equal ``--engine dist``'s
bitwise, for every DP scheme; a replica SIGKILLed mid-step leaves the others training to the end, is
restarted, recovers the job's state from a live peer and ends with weights equal to theirs, and the
quorum changes are in events.jsonl and summary.json.
"""

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_same_model, assert_same_model_folder
from thinpipe.checkpoint import CheckpointError, load_part, sets
from thinpipe.cli import main
from thinpipe.comm.managed import ManagedGroup
from thinpipe.comm.meter import ByteMeter
from thinpipe.comm.recovery import SafeTransport
from thinpipe.comm.state_blob import MAGIC, decode_state, encode_state
from thinpipe.events import append_event, read_events

BASE = ["--set", "data.name=synthetic", "--set", "train.batch_size=2", "--set", "train.seq_len=32",
        "--set", "train.microbatches=2", "--set", "train.lr=1e-3", "--set", "model.name=tiny-llama",
        "--set", "mesh.pp=2"]


# ------------------------------------------------------------------------------------------ units

def test_the_recovery_wire_round_trips_a_state_and_never_unpickles():
    state = {"user": {"thinpipe": {"rank": {"stage": {"w": torch.randn(3, 4)},
                                            "in_flight": [(3, 1, {"a": torch.ones(2)})]},
                                   "boundaries": {0: {"p": torch.arange(4)}}, "members": [0, 2],
                                   "job_bytes": {"dp": 10}}},
             "torchft": {"step": 7, "batches_committed": 14}}
    back = decode_state(encode_state(7, state), 7, "peer")
    assert back["torchft"] == {"step": 7, "batches_committed": 14}
    got = back["user"]["thinpipe"]
    assert torch.equal(got["rank"]["stage"]["w"], state["user"]["thinpipe"]["rank"]["stage"]["w"])
    assert got["rank"]["in_flight"][0][:2] == (3, 1) and torch.equal(got["boundaries"][0]["p"], torch.arange(4))
    with pytest.raises(CheckpointError, match="step 8 was asked for"):
        decode_state(encode_state(7, state), 8, "peer")
    import pickle

    for blob in (pickle.dumps(state), MAGIC + (10**12).to_bytes(8, "big") + b"{}", encode_state(7, state)[:-9]):
        with pytest.raises(CheckpointError, match="the replica cannot join"):
            decode_state(blob, 7, "peer")


def test_a_joiner_that_asks_before_the_state_is_staged_waits_for_it():
    import threading

    # 2 s: how long its server waits for a state to be staged; the same job key signs and checks it
    tr = SafeTransport(timedelta(seconds=2), bytes(range(32)), host="127.0.0.1")
    try:
        got = {}
        th = threading.Thread(
            target=lambda: got.update(s=tr.recv_checkpoint(0, tr.metadata(), 5, timedelta(seconds=10))))
        th.start()
        tr.send_checkpoint([1], 5, {"user": {"x": torch.ones(3)}, "torchft": {"step": 5}}, timedelta(seconds=1))
        th.join(10)
        assert torch.equal(got["s"]["user"]["x"], torch.ones(3))
        tr.disallow_checkpoint()
        with pytest.raises(Exception, match="404"):
            tr.recv_checkpoint(0, tr.metadata(), 6, timedelta(seconds=10))  # nothing staged for step 6: refused
    finally:
        tr.shutdown()


class FakeManager:
    """torchft's Manager as the DP group sees it (torchft's own DiLoCo tests mock it the same way)."""

    def __init__(self, participants: int):
        self.participants, self.posted = participants, []

    def num_participants(self):
        return self.participants

    def allreduce(self, t, reduce_op=None):
        self.posted.append((t.clone(), reduce_op))
        t.mul_(self.participants)  # every member holds the same tensor: the sum is n times it

        class W:
            def wait(self):
                return True
        return W()


def test_the_managed_group_sums_and_its_size_is_the_quorum():
    from thinpipe.dp.allreduce import allreduce_average

    m = FakeManager(3)
    g = ManagedGroup(m, None, ByteMeter(), "dp")
    assert g.size == 3
    grads = {"a": torch.full((4,), 2.0), "b": torch.full((2, 2), 6.0)}
    for w in allreduce_average(grads, g, 0, g.size):
        w.wait()
    assert torch.equal(grads["a"], torch.full((4,), 2.0)) and torch.equal(grads["b"], torch.full((2, 2), 6.0))
    assert str(m.posted[0][1]).endswith("SUM")
    assert g.meter.totals["dp"] == 2 * 2 * 8 * 4 // 3  # ring formula over the 3 replicas present
    m.participants = 2
    assert g.size == 2  # a replica left: the next average divides by 2


def test_events_are_appended_one_json_line_each(tmp_path):
    append_event(tmp_path, "quorum", step=3, members=[0, 2], left=[1], joined=[])
    append_event(tmp_path, "recovered", step=9, replica=1)
    ev = read_events(tmp_path)
    assert [e["event"] for e in ev] == ["quorum", "recovered"] and ev[0]["left"] == [1]


@pytest.mark.parametrize("args, message", [
    (["train", "--out", "X", "--engine", "elastic", "--set", "mesh.anchor=1", "--set", "mesh.dp=2"],
     "elastic replicas do not run an anchor circuit yet"),
    (["train", "--out", "X", "--engine", "elastic", "--set", "mesh.dp=2"],
     "--engine elastic needs \\$REPLICA_GROUP_ID"),
    (["train", "--out", "X", "--engine", "elastic", "--resume"], "an elastic job resumes through its launcher"),
    (["launch", "--elastic", "--", "train", "--out", "X", "--resume", "--set", "mesh.dp=2"],
     "--resume: .* holds no elastic job \\(no events.jsonl\\)"),
    (["train", "--out", "X", "--set", "elastic.min_replicas=3", "--set", "mesh.dp=2"],
     "elastic.min_replicas = 3 exceeds mesh.dp = 2"),
    (["launch", "--elastic", "--nproc", "3", "--", "train", "--out", "X", "--set", "mesh.dp=2", "--set", "mesh.pp=2"],
     "--nproc 3 does not match an elastic job of mesh.dp x mesh.pp = 2 x 2 = 4"),
    (["launch", "--elastic", "--max-restarts", "-1", "--", "train", "--out", "X"], "--max-restarts must be >= 0"),
    (["launch", "--", "train", "--out", "X"], "thinpipe launch needs --nproc N"),
    (["train", "--out", "X", "--engine", "elastic", "--init-from", "X"],
     "--init-from is not taken by --engine elastic"),
    (["train", "--out", "X", "--engine", "elastic", "--set", "mesh.dp=2", "--set", "mesh.pp=2", "--set",
      "mesh.split=auto"], "mesh.split = auto is agreed by the ranks of one world"),
])
def test_bad_elastic_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    args = [str(tmp_path / "run") if a == "X" else a for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    import re

    assert re.search(message, err[0]), err[0]


def test_a_folder_holding_an_elastic_job_is_refused_without_overwrite(tmp_path, capsys):
    out = tmp_path / "job"
    (out / "replica0").mkdir(parents=True)
    (out / "events.jsonl").write_text("")
    assert main(["launch", "--elastic", "--", "train", "--out", str(out), "--set", "mesh.dp=2"]) == 2
    assert "holds an elastic job (events.jsonl, replica0): add --overwrite" in capsys.readouterr().err


# ------------------------------------------------------------------------------- real processes

def run_job(cmd: list[str], timeout: int = 600, **env_extra) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run([sys.executable, "-m", "thinpipe", *cmd], env=env, capture_output=True, text=True,
                          timeout=timeout)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_weights(folder: Path, pp: int) -> list[dict]:
    _, d = sets(folder / "checkpoint")[0]
    return [load_part(d, f"rank{r}")["rank"]["stage"] for r in range(pp)]


SCHEMES = {
    "all-reduce": ["--set", "dp.kind=allreduce", "--set", "boundary.kind=mask"],
    "PowerSGD": ["--set", "dp.kind=powersgd", "--set", "dp.start_step=1"],
    "DiLoCo": ["--set", "dp.kind=diloco", "--set", "dp.inner_steps=2"],
    # int8 fragments: the managed group's all-gather
    "Streaming DiLoCo in flight, quantized": ["--set", "dp.kind=streaming-diloco", "--set", "dp.inner_steps=2",
                                              "--set", "dp.fragments=2", "--set", "dp.overlap=1",
                                              "--set", "dp.quantize=true"],
}


@pytest.mark.dist
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_with_no_failure_every_replica_equals_the_dist_run_bitwise(tmp_path, scheme):
    args = [*BASE, "--set", "mesh.dp=2", "--set", "train.steps=5", "--set", "eval.every=2", "--set",
            'eval.tasks=["arc_easy"]', "--set", "eval.limit=2", *SCHEMES[scheme]]
    d = run_job(["launch", "--nproc", "4", "--", "train", "--out", str(tmp_path / "dist"), "--quiet", *args])
    assert d.returncode == 0, d.stderr[-3000:]
    e = run_job(["launch", "--elastic", "--", "train", "--out", str(tmp_path / "el"), "--quiet", *args])
    assert e.returncode == 0, e.stderr[-3000:]
    want = rows(tmp_path / "dist" / "metrics.jsonl")
    for replica in ("replica0", "replica1"):
        # each replica measures the held-out loss (and eval.tasks) on its own weights (--engine dist on replica
        # 0's): with DiLoCo they differ between outer steps, so replica 1's are not dist's
        keys = sorted({k for r in want for k in r if k != "wall_s" and (replica == "replica0" or
                                                                        not k.startswith("val_"))})
        got = rows(tmp_path / "el" / replica / "metrics.jsonl")
        assert [{k: r.get(k) for k in keys} for r in got] == [{k: r.get(k) for k in keys} for r in want], replica
        s = json.loads((tmp_path / "el" / replica / "summary.json").read_text())
        assert s["engine"] == "elastic" and s["rollbacks"] == 0 and s["tokens"] == 5 * 2 * 2 * 32
        # where its time went (issue 54): a row per stage rank per step, in the job's rank numbering
        ranks = rows(tmp_path / "el" / replica / "ranks.jsonl")
        r = int(replica[-1])
        assert sorted({(x["rank"], x["stage"]) for x in ranks}) == [(2 * r, 0), (2 * r + 1, 1)] and len(ranks) == 10
    s, sd = (json.loads((p / "summary.json").read_text()) for p in (tmp_path / "el" / "replica0", tmp_path / "dist"))
    assert s["final_val_loss"] == sd["final_val_loss"] and s["val_points"] == sd["val_points"]
    assert s["final_val_acc_arc_easy"] == sd["final_val_acc_arc_easy"]
    assert any("val_acc_arc_easy" in r for r in want)
    # replica r's weights are the dist run's rank grid[r][s] part (DiLoCo's local weights differ by replica)
    _, dd = sets(tmp_path / "dist" / "checkpoint")[0]
    for r in range(2):
        mine = final_weights(tmp_path / "el" / f"replica{r}", 2)
        for s in range(2):
            theirs = load_part(dd, f"rank{r * 2 + s}")["rank"]["stage"]
            assert all(torch.equal(mine[s][k], theirs[k]) for k in theirs), (r, s)
    events = read_events(tmp_path / "el")
    assert [e["members"] for e in events if e["event"] == "quorum"] == [[0, 1]]
    job = json.loads((tmp_path / "el" / "summary.json").read_text())
    assert job["replicas_finished"] == 2 and job["restarts"] == 0 and job["steps_redone"] == 0
    assert job["final_val_loss"] == json.loads((tmp_path / "dist" / "summary.json").read_text())["final_val_loss"]
    # a job folder is a run folder: its model is the dist job's (with DiLoCo after 5 steps: the outer weights)
    assert main(["compare", str(tmp_path / "dist"), str(tmp_path / "el"), "--json"]) == 0
    assert_same_model(tmp_path / "el", tmp_path / "dist")
    assert_same_model_folder(tmp_path / "el" / "model", tmp_path / "dist" / "model")  # the launcher wrote it
    assert job["model"] == "model"


@pytest.mark.dist
@pytest.mark.slow
def test_a_replica_killed_mid_step_is_restarted_and_rejoins_with_its_peers_weights(tmp_path):
    """3 replicas x 2 stages; replica 1's stage 1 SIGKILLs itself mid-step at step 3 (between its
    backward and its DP all-reduce). The links are slowed so that the job outlasts the restart."""
    out = tmp_path / "job"
    steps = 40  # ~0.5 s each: a restarted replica (forked from the launcher's warm server) is back within seconds
    p = run_job(["launch", "--elastic", "--max-restarts", "1", "--", "train", "--out", str(out), "--quiet", *BASE,
                 "--set", "mesh.dp=3", "--set", f"train.steps={steps}", "--set", "train.checkpoint_every=0",
                 "--set", "link.pp_mbps=0.5"], timeout=900, THINPIPE_ELASTIC_KILL="1:1:3")
    assert p.returncode == 0, p.stderr[-4000:]
    events = read_events(out)
    kinds = [e["event"] for e in events]
    failed = [e for e in events if e["event"] == "replica_failed"]
    assert [(f["replica"], f["stage"], f["how"]) for f in failed] == [(1, 1, "signal SIGKILL")]
    assert kinds.count("replica_restarted") == 1
    quorums = [(e["members"], e["left"], e["joined"]) for e in events if e["event"] == "quorum"]
    recovered = [e for e in events if e["event"] == "recovered"]
    assert quorums[0] == ([0, 1, 2], [], [0, 1, 2]) and len(recovered) == 1
    if len(quorums) == 1:
        # the restarted replica was back before the survivors formed a smaller quorum (torchft's timing): it
        # healed at the step that did not commit, from their committed state, and no step went without it
        assert recovered[0]["step"] == 3, quorums
    else:
        assert quorums[1] == ([0, 2], [1], []) and quorums[2] == ([0, 1, 2], [], [1]), quorums
        assert 3 < recovered[0]["step"] < steps
    # the survivors trained every step without a stop (step 3 redone once), replica 1 again from its recovery on
    for survivor in ("replica0", "replica2"):
        assert [r["step"] for r in rows(out / survivor / "metrics.jsonl")] == list(range(steps))
    back = rows(out / "replica1-restart1" / "metrics.jsonl")
    assert [r["step"] for r in back] == list(range(recovered[0]["step"], steps))
    assert [r["step"] for r in rows(out / "replica1" / "metrics.jsonl")] == [0, 1, 2]
    # the restarted replica ends with its peers' weights, bitwise
    w0 = final_weights(out / "replica0", 2)
    for other in ("replica2", "replica1-restart1"):
        w = final_weights(out / other, 2)
        assert all(torch.equal(w[s][k], w0[s][k]) for s in range(2) for k in w0[s]), other
    job = json.loads((out / "summary.json").read_text())
    assert job["replicas_finished"] == 3 and job["restarts"] == 1 and job["steps_redone"] == 1
    assert job["rejoins"][0]["replica"] == 1 and job["rejoins"][0]["rejoin_s"] > 0
    assert job["replica_steps_missed"] == recovered[0]["step"] - 3
    # tokens: every replica-step that committed, the missing ones not counted
    assert job["tokens"] == (3 * steps - job["replica_steps_missed"]) * 2 * 32
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == list(range(steps))


@pytest.mark.dist
@pytest.mark.slow
def test_a_replica_lost_for_good_leaves_diloco_averaging_over_the_others(tmp_path):
    """--max-restarts 0: replica 2 (stage 0, its manager's host) SIGKILLed at step 5 is given up; the
    two others finish the job, their DiLoCo outer steps averaging over the two of them."""
    out = tmp_path / "job"
    steps = 12
    p = run_job(["launch", "--elastic", "--max-restarts", "0", "--", "train", "--out", str(out), "--quiet", *BASE,
                 "--set", "mesh.dp=3", "--set", f"train.steps={steps}", "--set", "train.checkpoint_every=0",
                 "--set", "dp.kind=diloco", "--set", "dp.inner_steps=2"], THINPIPE_ELASTIC_KILL="2:0:5")
    assert p.returncode == 0, p.stderr[-4000:]
    events = read_events(out)
    assert [e["replica"] for e in events if e["event"] == "replica_given_up"] == [2]
    assert not [e for e in events if e["event"] == "replica_restarted"]
    assert [(e["step"], e["members"]) for e in events if e["event"] == "quorum"] == [(0, [0, 1, 2]), (5, [0, 1])]
    for survivor in ("replica0", "replica1"):
        assert [r["step"] for r in rows(out / survivor / "metrics.jsonl")] == list(range(steps))
    # the job ends on an outer step (12 = 6 x 2): local == global, the same on both survivors
    w0, w1 = final_weights(out / "replica0", 2), final_weights(out / "replica1", 2)
    assert all(torch.equal(w0[s][k], w1[s][k]) for s in range(2) for k in w0[s])
    job = json.loads((out / "summary.json").read_text())
    assert job["replicas_finished"] == 2 and job["replica_steps_missed"] == steps - 5
    assert job["tokens"] == (3 * steps - (steps - 5)) * 2 * 32


def test_an_unreachable_lighthouse_is_one_line_in_seconds(tmp_path, capsys, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "REPLICA_GROUP_ID": "0",
                 "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}.items():
        monkeypatch.setenv(k, v)
    assert main(["train", "--engine", "elastic", "--out", str(tmp_path / "r"), *BASE, "--set", "mesh.dp=2",
                 "--set", "mesh.pp=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no torchft lighthouse answers there" in err[0]


@pytest.mark.dist
def test_an_input_error_a_replica_finds_stops_the_job_with_exit_2_instead_of_restarting(tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    p = run_job(["launch", "--elastic", "--max-restarts", "3", "--", "train", "--out", str(tmp_path / "job"), "--quiet",
                 *BASE, "--set", "mesh.dp=2", "--set", f"data.name={bad}", "--set", "train.steps=2"])
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"error: {bad}:2: not valid JSON" in p.stderr
    events = read_events(tmp_path / "job")
    assert [e["event"] for e in events].count("replica_restarted") == 0 and events[-1]["event"] == "job_stopped"


def test_the_job_summary_counts_missed_replica_steps_rejoin_time_and_merges_rows(tmp_path):
    """elastic_summary from replica folders and events alone (what the launcher writes at the end)."""
    from thinpipe.commands.launch_elastic import elastic_summary
    from thinpipe.config import load_config

    cfg = load_config(None, ["mesh.dp=3", "train.steps=10"])
    out = tmp_path / "job"

    def folder(name, steps, replica, restart, val):
        (out / name).mkdir(parents=True)
        (out / name / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "from": name}) + "\n"
                                                          for s in steps))
        (out / name / "summary.json").write_text(json.dumps({
            "replica": replica, "restart": restart, "final_val_loss": val, "tokens": 123, "wall_s": 9.0,
            "engine": "elastic", "val_points": [[0, 2.0], [10, val]], "bytes_per_token": {"pp_fwd": 1.0}}))
        (out / name / "config.toml").write_text(cfg.to_toml())

    folder("replica0", range(10), 0, 0, 1.5)
    folder("replica2", range(10), 2, 0, 1.5)
    (out / "replica1").mkdir()
    (out / "replica1" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "from": "replica1"}) + "\n"
                                                            for s in range(3)))
    folder("replica1-restart1", range(6, 10), 1, 1, 1.5)
    t = 1000.0
    for ev, fields in [("quorum", {"step": 0, "members": [0, 1, 2], "left": [], "joined": [0, 1, 2]}),
                       ("replica_failed", {"replica": 1, "stage": 1, "how": "signal SIGKILL", "wall_s": 20.0}),
                       ("rolled_back", {"step": 3, "replica": 0}), ("rolled_back", {"step": 3, "replica": 2}),
                       ("quorum", {"step": 3, "members": [0, 2], "left": [1], "joined": []}),
                       ("replica_restarted", {"replica": 1, "restart": 1}),
                       ("recovered", {"step": 6, "replica": 1, "restart": 1}),
                       ("quorum", {"step": 6, "members": [0, 1, 2], "left": [], "joined": [1]})]:
        t += 2.0
        (out / "events.jsonl").open("a").write(json.dumps({"event": ev, "time": t, **fields}) + "\n")
    s = elastic_summary(out, cfg)
    assert s["replicas_finished"] == 3 and s["restarts"] == 1 and s["steps_redone"] == 1
    assert s["replica_steps_missed"] == 3  # replica 1 absent from steps 3, 4 and 5
    assert s["rejoins"] == [{"replica": 1, "at_step": 6, "restart": 1, "rejoin_s": 10.0}]
    assert s["final_val_loss"] == 1.5 and s["tokens"] == 123 and "replica" not in s
    merged = rows(out / "metrics.jsonl")
    assert [r["step"] for r in merged] == list(range(10)) and {r["from"] for r in merged} == {"replica0"}
    assert (out / "config.toml").is_file()


@pytest.mark.dist
@pytest.mark.slow
def test_a_whole_job_that_stopped_resumes_from_its_replicas_checkpoints_bitwise(tmp_path):
    """Every rank of every replica fails at step 6 (THINPIPE_FAULT_AT_STEP) with no restarts left: the
    job ends without a finished replica. --resume continues each replica from its checkpoint of step 4;
    the result equals an uninterrupted elastic job's, row for row and weight for weight."""
    args = [*BASE, "--set", "mesh.dp=2", "--set", "train.steps=9", "--set", "train.checkpoint_every=4",
            "--set", "eval.every=3", "--set", "dp.kind=powersgd", "--set", "dp.start_step=1"]
    p = run_job(["launch", "--elastic", "--", "train", "--out", str(tmp_path / "ref"), "--quiet", *args])
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "job"
    p = run_job(["launch", "--elastic", "--max-restarts", "0", "--", "train", "--out", str(out), "--quiet", *args],
                THINPIPE_FAULT_AT_STEP="6")
    assert p.returncode == 1 and "injected fault at step 6" in p.stderr
    assert not (out / "replica0" / "summary.json").exists()
    before = rows(out / "replica0" / "metrics.jsonl")
    assert [r["step"] for r in before] == list(range(6))
    p = run_job(["launch", "--elastic", "--", "train", "--out", str(out), "--resume", "--quiet", *args])
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = [e for e in read_events(out) if e["event"] == "job_resumed"]
    assert len(resumed) == 1 and resumed[0]["from_checkpoint"] == [0, 1]
    after = rows(out / "replica0" / "metrics.jsonl")
    assert after[:4] == before[:4]  # kept as written (wall_s too): steps 0-3 were not trained again
    assert [r["wall_s"] for r in after[4:6]] != [r["wall_s"] for r in before[4:6]]  # steps 4-5 were
    for r in ("replica0", "replica1"):
        want, got = rows(tmp_path / "ref" / r / "metrics.jsonl"), rows(out / r / "metrics.jsonl")
        keys = [k for k in want[0] if k != "wall_s"]
        assert [{k: x.get(k) for k in keys} for x in got] == [{k: x.get(k) for k in keys} for x in want], r
        a, b = final_weights(tmp_path / "ref" / r, 2), final_weights(out / r, 2)
        assert all(torch.equal(a[s][k], b[s][k]) for s in range(2) for k in a[s]), r
    job, ref = (json.loads((d / "summary.json").read_text()) for d in (out, tmp_path / "ref"))
    assert job["final_val_loss"] == ref["final_val_loss"] and job["tokens"] == ref["tokens"]


@pytest.mark.dist
@pytest.mark.slow
def test_gspo_on_elastic_replicas_survives_a_kill_and_the_rejoined_replica_ends_equal(tmp_path):
    """GSPO through the one step path on torchft: 2 replicas x 2 stages, replica 1's stage 1 SIGKILLed mid-step at
    step 2; replica 0 trains every step to the end, replica 1 is restarted, heals from it (its objective's state
    and data position too: wherever the job is when it is back) and ends with its weights; rollouts are keyed by
    (seed, step, replica), so the rejoined replica samples what it would have."""
    from tests.integration.test_post_sft_train import gspo_sets, prompts_file

    out, steps = tmp_path / "job", 16
    sets = gspo_sets(prompts_file(tmp_path, n=200), **{"mesh.dp": 2, "train.steps": steps, "boundary.kind": "mask",
                                                       "boundary.p": 0.5})
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    p = run_job(["launch", "--elastic", "--max-restarts", "1", "--", "train", "--out", str(out), "--quiet", *args],
                timeout=900, THINPIPE_ELASTIC_KILL="1:1:2")
    assert p.returncode == 0, p.stderr[-4000:]
    events = read_events(out)
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1 and 2 <= recovered[0]["step"] < steps
    assert [r["step"] for r in rows(out / "replica0" / "metrics.jsonl")] == list(range(steps))
    back = rows(out / "replica1-restart1" / "metrics.jsonl")
    assert [r["step"] for r in back] == list(range(recovered[0]["step"], steps))
    assert all("reward_mean" in r for r in back)
    w0, w1 = final_weights(out / "replica0", 2), final_weights(out / "replica1-restart1", 2)
    assert all(torch.equal(w1[s][k], w0[s][k]) for s in range(2) for k in w0[s])
    job = json.loads((out / "summary.json").read_text())
    assert job["replicas_finished"] == 2 and job["restarts"] == 1 and job["objective"] == "gspo"
