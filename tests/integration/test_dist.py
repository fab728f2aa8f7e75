"""Real processes (torchrun, gloo) == the single-process simulation: losses, held-out loss, bytes.

Each case trains a tiny model both ways with identical arguments; the distributed run's per-step
training loss, final held-out loss and metered bytes per axis must equal the simulation's bitwise
(same operations in the same order on every rank)."""

import contextlib
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.helpers import assert_same_model, assert_same_model_folder, assert_same_run_files
from thinpipe.checkpoint import load_part, sets
from thinpipe.cli import main
from thinpipe.config import load_config

BASE = ["--set", "data.name=synthetic", "--set", "train.steps=3", "--set", "train.batch_size=2",
        "--set", "train.seq_len=32", "--set", "train.microbatches=2", "--set", "train.lr=1e-3",
        "--set", "train.checkpoint_every=0"]
CASES = {
    "mask + PowerSGD, 2 replicas x 2 stages": (4, ["--set", "model.name=tiny-llama", "--set", "mesh.pp=2",
                                                   "--set", "mesh.dp=2", "--set", "boundary.kind=mask",
                                                   "--set", "dp.kind=powersgd", "--set", "dp.start_step=1",
                                                   "--set", "train.model_rank=3", "--set", "eval.every=2",
                                                   "--set", "eval.tasks=[\"arc_easy\"]", "--set", "eval.limit=4"]),
    # a mixture of experts trained with each stage's router loss (models/router_loss.py): router_aux_loss in every
    # row, equal field for field (issue 53)
    # issue 54: a codec per boundary and a link per boundary (the second 10x slower: named the slowest link)
    "two kinds and a slower link, 3 stages": (3, ["--set", "model.name=tiny-llama", "--set", "mesh.pp=3",
                                                  "--set", "boundary.kinds=[quant4, outlier]",
                                                  "--set", "boundary.quant_group=16",
                                                  "--set", "boundary.outlier.channels=4",
                                                  "--set", "link.pp_mbps=[400, 40]"]),
    "tiny Mixtral with its router loss, 2 stages": (2, ["--set", "model.name=tiny-mixtral", "--set", "mesh.pp=2"]),
    "MAPL-VQ, 3 stages": (3, ["--set", "model.name=tiny-llama", "--set", "mesh.pp=3", "--set", "boundary.kind=mapl-vq",
                              "--set", "boundary.rank=16", "--set", "boundary.vq_codes=32",
                              "--set", "boundary.vq_sync_codes=4"]),
    "tied Qwen2 + Streaming DiLoCo in flight, GPipe": (4, ["--set", "model.name=tiny-qwen2", "--set", "mesh.pp=2",
                                                           "--set", "mesh.dp=2", "--set", "dp.kind=streaming-diloco",
                                                           "--set", "dp.inner_steps=2", "--set", "dp.fragments=2",
                                                           "--set", "dp.overlap=1", "--set", "train.steps=5",
                                                           "--set", "train.schedule=gpipe"]),
    # The anchor row: 2 fast replicas x 2 stages + 1 anchor replica; priors every step, due 2 later,
    # pushed as PowerSGD factors; masking + spectral correction + PowerSGD DP.
    "mask + AP + PowerSGD, 2 x 2 + anchor row": (6, ["--set", "model.name=tiny-llama", "--set", "mesh.pp=2",
                                                    "--set", "mesh.dp=2", "--set", "mesh.anchor=1",
                                                    "--set", "boundary.kind=mask", "--set", "dp.kind=powersgd",
                                                    "--set", "dp.start_step=1", "--set", "anchor.staleness=2",
                                                    "--set", "anchor.every=1", "--set", "anchor.push_rank=2",
                                                    "--set", "train.steps=6"]),
    # AQ-SGD's per-example buffers at both ends of two boundaries: 2 rows, so steps 2-5 revisit them.
    "AQ-SGD over revisited rows, 3 stages": (3, ["--set", "model.name=tiny-llama", "--set", "mesh.pp=3",
                                                 "--set", "boundary.kind=aqsgd", "--set", "data.max_examples=2",
                                                 "--set", "train.steps=5"]),
    # Outlier channels calibrated on replica 0's sender and broadcast; rotated 2-bit tiles forward on issue 26's
    # Lloyd-Max grid, entropy coded (payloads of the data's length), a token-sparse 1-bit backward (the receiver's
    # bitmap of the kept tokens crosses with their codes).
    "outlier channels + Lloyd-Max entropy coded + token-sparse backward, 2 replicas x 3 stages": (6, [
        "--set", "model.name=tiny-llama", "--set", "mesh.pp=3", "--set", "mesh.dp=2", "--set", "boundary.kind=outlier",
        "--set", "boundary.outlier_channels=4", "--set", "boundary.quant_group=16",
        "--set", "boundary.outlier_grid=lloyd-max", "--set", "boundary.outlier_bwd_scale_group=-1",
        "--set", "boundary.bwd_bits=1", "--set", "boundary.outlier_bwd_tokens=0.5",
        "--set", "boundary.outlier_entropy=true"]),
    # Issue 36's KLT codec: the basis fitted by replica 0's sender, broadcast (metered on pp_params) to both
    # ends of every replica; loss tokens 3 bits/dim, the others 1 (payload shapes follow the labels); at step 2
    # both ends of each replica refit the basis and fit the gradient's own from the decoded data they hold.
    "KLT, loss/context bits, refresh, 2 replicas x 2 stages": (4, [
        "--set", "model.name=tiny-llama", "--set", "mesh.pp=2", "--set", "mesh.dp=2", "--set", "boundary.kind=klt",
        "--set", "boundary.quant_group=16", "--set", "boundary.klt_bits=3", "--set", "boundary.klt_context_bits=1",
        "--set", "boundary.klt_refresh_every=2", "--set", "train.steps=4"]),
    # Issue 52's unbiased, entropy-coded forward: both ends draw the dither from the PRF, the coded streams'
    # lengths vary with the data and are metered as coded (the same bytes on the wire as in the simulation); the
    # half-token backward drawn (unbiased) by each gradient's sender.
    "klt-dither, sampled backward, 3 stages": (3, [
        "--set", "model.name=tiny-llama", "--set", "mesh.pp=3", "--set", "boundary.kind=klt-dither",
        "--set", "boundary.quant_group=16", "--set", "boundary.klt-dither.bwd_select=sample",
        "--set", "train.steps=3"]),
    # The bottleneck's halves are stage parameters: DP-averaged like the rest, evaluated through.
    # also a checkpoint and a held-out loss every 2 steps (the rows' val_loss, the checkpoint mid-run)
    "bottleneck, 2 replicas x 2 stages": (4, ["--set", "model.name=tiny-llama", "--set", "mesh.pp=2",
                                              "--set", "mesh.dp=2", "--set", "boundary.kind=bottleneck",
                                              "--set", "boundary.p=0.75", "--set", "train.steps=4",
                                              "--set", "train.checkpoint_every=2", "--set", "eval.every=2",
                                              "--set", "train.keep_checkpoints=1"]),
    # LoRA: the anchor row pulls and pushes adapters only; DiLoCo syncs adapters only.
    "LoRA + mask + AP + DiLoCo, 2 x 2 + anchor row": (6, ["--set", "model.name=tiny-llama", "--set", "mesh.pp=2",
                                                         "--set", "mesh.dp=2", "--set", "mesh.anchor=1",
                                                         "--set", "boundary.kind=mask", "--set", "dp.kind=diloco",
                                                         "--set", "dp.inner_steps=2", "--set", "anchor.staleness=2",
                                                         "--set", "anchor.every=1", "--set", "train.lora.rank=4",
                                                         "--set", "train.steps=5",
                                                         "--set", "train.activation_checkpointing=true"]),
    # (MAPL-VQ has no anchor circuit: its boundary is part of the model, so there is no dense pass.)
    "top-K + AP + DiLoCo, dense push, 2 x 2 + anchor row": (6, [
        "--set", "model.name=tiny-llama", "--set", "mesh.pp=2", "--set", "mesh.dp=2", "--set", "mesh.anchor=1",
        "--set", "boundary.kind=topk", "--set", "dp.kind=diloco", "--set", "dp.inner_steps=2",
        "--set", "anchor.staleness=2", "--set", "train.steps=7"]),
}


def launch(nproc: int, out, args: list[str], *extra: str, **env_extra: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run([sys.executable, "-m", "thinpipe", "launch", "--nproc", str(nproc), "--", "train",
                           "--out", str(out), "--quiet", *args, *extra], env=env, capture_output=True, text=True,
                          timeout=300)


def results(folder):
    s = json.loads((folder / "summary.json").read_text())
    losses = [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines()]
    anchor = {k: s.get(k) for k in ("priors_consumed", "anchor_staleness_mean", "anchor_staleness_max")}
    return losses, s["final_val_loss"], {k: v for k, v in s.items() if k.endswith("_bytes")}, anchor


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_dist_equals_sim(case, tmp_path, one_thread):
    nproc, args = CASES[case]
    sim, dist_out = tmp_path / "sim", tmp_path / "dist"
    assert main(["train", "--out", str(sim), "--quiet", *BASE, *args]) == 0
    r = launch(nproc, dist_out, [*BASE, *args])
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(dist_out) == results(sim)
    if "anchor row" not in case:
        # every field of every row and of the summary, but wall-clock ones. (With an anchor row, a row's
        # anchor_bytes counts the pushes that have arrived by then, asynchronous in dist: totals equal above.)
        assert_same_run_files(sim, dist_out)
    # every rank, the anchor's too, holds its part of the final set (and only of it: keep_checkpoints)
    assert sorted(p.name for p in (dist_out / "checkpoint").glob("*/*.sha256")) == \
        [f"rank{r}.sha256" for r in range(nproc)]
    if case in MODEL_CASES:  # the job's model read back from the ranks' parts is the simulation's (issue 50)
        assert_same_model(dist_out, sim)
        # and the model the job wrote at its end (gathered to rank 0) is the simulation's, tensor for tensor; a
        # boundary that is part of the model writes none in either engine
        if "MAPL" in case:
            assert not (dist_out / "model").exists() and not (sim / "model").exists()
            for run in (sim, dist_out):  # its projectors and codebooks, read back from either engine's folder
                assert main(["analyze", "--run", str(run), "--batches", "1"]) == 0
            analyses = [{k: v for k, v in json.loads((r / "analysis" / "analysis.json").read_text()).items()
                         if k != "run"} for r in (sim, dist_out)]
            assert analyses[0] == analyses[1]
        else:
            assert_same_model_folder(dist_out / "model", sim / "model")
    if case == "LoRA + mask + AP + DiLoCo, 2 x 2 + anchor row":
        check_parts_on_two_machines(dist_out, sim, tmp_path)
    if "slower link" in case:
        s = json.loads((dist_out / "summary.json").read_text())
        ranks = [json.loads(x) for x in (dist_out / "ranks.jsonl").read_text().splitlines()]
        assert len(ranks) == 3 * 3 and s["slowest_link"] == 1, (s["slowest_link"], ranks[-3:])
        assert all(r["send_mbps"]["1"] < 41 for r in ranks if "1" in r["send_mbps"])
    if "Mixtral" in case:
        rows = [json.loads(x) for x in (dist_out / "metrics.jsonl").read_text().splitlines()]
        assert all(r["router_aux_loss"] > 1.0 for r in rows)  # near top_k = 2 when balanced; 0 would be none
    if case == "mask + PowerSGD, 2 replicas x 2 stages":
        # train.model_rank = 3 (replica 1's last stage) wrote it: both stages of replica 0 sent it their shares
        from safetensors.torch import load_file

        s = json.loads((dist_out / "summary.json").read_text())
        whole = sum(t.numel() * t.element_size() for t in load_file(dist_out / "model" / "model.safetensors").values())
        assert (s["model_rank"], s["model_format"], s["model_bytes"]) == (3, "transformers", whole)
        # eval.tasks: scored with the held-out loss, in the rows that carry it and the summary (every row and
        # summary field equal to the simulation's: assert_same_run_files above)
        rows = [json.loads(x) for x in (dist_out / "metrics.jsonl").read_text().splitlines()]
        assert all(("val_acc_arc_easy" in r) == ("val_loss" in r) for r in rows) and "final_val_acc_arc_easy" in s
        assert any("val_acc_arc_easy" in r for r in rows)
        check_commands_take_a_dist_run(dist_out, sim, tmp_path)


@pytest.mark.dist
def test_a_job_on_two_machines_ends_with_its_model_on_rank_0s(tmp_path):
    """A job as two machines run it: two torchrun launchers on this host (``--nnodes 2``), each with its own
    ``--out``. Node 1's stages (2 and 3 of a 4-stage pipeline) send their shares of the model to rank 0 over the
    job's wire: node 0's folder ends with ``OUT/model/``, node 1's holds its ranks' checkpoint parts and no model,
    and ``export --run A --run B`` of the two folders writes the same tensors."""
    from thinpipe.comm.jobkey import KEY_ENV, write_key_file
    from thinpipe.commands.launching import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", KEY_ENV: str(write_key_file(tmp_path / "job.key"))}
    port = free_port()
    args = [*BASE, "--set", "model.name=tiny-llama", "--set", "mesh.pp=4", "--set", "train.steps=2"]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m",
                               "thinpipe", "train", "--engine", "dist", "--out", str(tmp_path / f"node{n}"), "--quiet",
                               *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    a, b = tmp_path / "node0", tmp_path / "node1"
    assert (a / "model" / "config.json").is_file() and not (b / "model").exists() and not (b / "config.toml").exists()
    assert sorted(p.name for p in (b / "checkpoint").glob("*/*.sha256")) == ["rank2.sha256", "rank3.sha256"]
    assert json.loads((a / "summary.json").read_text())["model_bytes"] > 0
    assert main(["export", "--run", str(a), "--run", str(b), "--out", str(tmp_path / "x")]) == 0
    assert_same_model_folder(tmp_path / "x", a / "model")


def check_commands_take_a_dist_run(dist_out, sim, tmp_path):
    """``eval --run``, ``generate --run``, ``prune --run``, ``probe --run`` and ``train --init-from`` take the dist
    run as they take the simulation's of the same job: the same numbers, the same tokens."""
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("the cat sat on the mat", "one two three")))
    said = {}
    for name, run in (("sim", sim), ("dist", dist_out)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["eval", "--run", str(run), "--perplexity", str(texts), "--json"]) == 0
            assert main(["generate", "--run", str(run), "--prompt", "the cat", "--max-new-tokens", "4", "--json"]) == 0
            assert main(["probe", "--run", str(run), "--kinds", "mask", "--batches", "1", "--json"]) == 0
        assert main(["prune", "--run", str(run), "--sparsity", "0,0.5", "--out", str(tmp_path / f"prune_{name}")]) == 0
        said[name] = (out.getvalue(), json.loads((tmp_path / f"prune_{name}" / "prune.json").read_text())["rows"])
    assert said["dist"] == said["sim"] and "perplexity" in said["sim"][0] and '"dense_loss"' in said["sim"][0]
    assert main(["train", "--init-from", str(dist_out), "--out", str(tmp_path / "phase2"), "--quiet", *BASE,
                 "--set", "model.name=tiny-llama", "--set", "train.steps=1"]) == 0


# the cases whose model is read back from the dist parts: LoRA + DiLoCo's outer weights + an anchor row's parts
# skipped, all-reduce replicas checked alike, a tied embedding with Streaming DiLoCo, MAPL-VQ's codebooks and AQ-SGD's
# buffers (each end keeps its own: Boundary.merged_state). (Every case passed it once; these five cover the rules.)
MODEL_CASES = ("LoRA + mask + AP + DiLoCo, 2 x 2 + anchor row", "mask + PowerSGD, 2 replicas x 2 stages",
               "tied Qwen2 + Streaming DiLoCo in flight, GPipe", "MAPL-VQ, 3 stages",
               "AQ-SGD over revisited rows, 3 stages")


def check_parts_on_two_machines(dist_out, sim, tmp_path):
    """A dist job's folder as two machines would hold it (rank 0's with config.toml and replica 0's parts, the
    other with replica 1's): ``export --run A --run B`` equals the simulation's export tensor for tensor; with a
    part missing, or parts of another job, it stops in one line (exit 2)."""
    import shutil

    from safetensors.torch import load_file

    a, b = tmp_path / "machine0", tmp_path / "machine1"
    shutil.copytree(dist_out, a)
    (b / "checkpoint").mkdir(parents=True)
    step = next((a / "checkpoint").iterdir())
    (b / "checkpoint" / step.name).mkdir()
    for r in (2, 3, 5):  # replica 1 (ranks 2, 3) and the anchor's stage 1 (rank 5) ran on the second machine
        for f in step.glob(f"rank{r}.*"):
            shutil.move(f, b / "checkpoint" / step.name / f.name)
    assert main(["export", "--run", str(sim), "--out", str(tmp_path / "x_sim")]) == 0
    assert main(["export", "--run", str(a), "--run", str(b), "--out", str(tmp_path / "x_dist")]) == 0
    want, got = (load_file(tmp_path / x / "model.safetensors") for x in ("x_sim", "x_dist"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert_same_model_folder(tmp_path / "x_sim", sim / "model")  # export --run == the model the run wrote at its end
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["export", "--run", str(a), "--out", str(tmp_path / "x_a")]) == 2  # machine 1's parts absent
    assert err.getvalue().count("\n") == 1 and "rank 2 (replica 1, stage 0)" in err.getvalue(), err.getvalue()
    part = b / "checkpoint" / step.name / "rank3.json"
    doc = json.loads(part.read_text())
    doc["state"]["world_size"] = 8  # as a part of a job of another shape would say
    part.write_text(json.dumps(doc))
    (b / "checkpoint" / step.name / "rank3.sha256").write_text(json.dumps(
        {n: hashlib.sha256((b / "checkpoint" / step.name / n).read_bytes()).hexdigest()
         for n in ("rank3.safetensors", "rank3.json")}))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["export", "--run", str(a), "--run", str(b), "--out", str(tmp_path / "x_b")]) == 2
    assert "parts of different jobs" in err.getvalue() and err.getvalue().count("\n") == 1, err.getvalue()


@pytest.mark.slow
def test_anchor_priors_change_the_trajectory_in_the_equivalence_case(tmp_path):
    """The anchor case above is not vacuous: priors are consumed, and without their share of the
    update (alpha = 1: the inner optimizer alone) the same run takes another trajectory."""
    nproc, args = CASES["mask + AP + PowerSGD, 2 x 2 + anchor row"]
    assert main(["train", "--out", str(tmp_path / "a"), "--quiet", *BASE, *args]) == 0
    assert main(["train", "--out", str(tmp_path / "b"), "--quiet", *BASE, *args,
                 "--set", "optim.spectral.alpha=1"]) == 0
    a, b = results(tmp_path / "a"), results(tmp_path / "b")
    assert a[3]["priors_consumed"] == 4 and a[3]["anchor_staleness_max"] == 2
    assert a[0][:3] == b[0][:3] and a[0][3:] != b[0][3:]  # the first prior is consumed at step 2


@pytest.mark.dist
def test_anchor_arrival_delivery_and_a_failing_anchor(tmp_path):
    """``arrival``: priors are consumed when they have arrived (realised staleness reported); an
    anchor rank that fails mid-run is reported and the fast circuit finishes without it."""
    nproc, args = CASES["mask + AP + PowerSGD, 2 x 2 + anchor row"]
    args = [*BASE, *args, "--set", "anchor.delivery=arrival", "--set", "train.steps=12"]
    r = launch(nproc, tmp_path / "ok", args)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert s["anchor_delivery"] == "arrival" and not s["anchor_failed"] and s["priors_consumed"] >= 1
    assert 0 <= s["anchor_staleness_mean"] <= s["anchor_staleness_max"] < 12 and s["anchor_bytes"] > 0
    r = launch(nproc, tmp_path / "fail", args, THINPIPE_FAULT_ANCHOR_AT_CYCLE="1")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "fail" / "summary.json").read_text())
    assert s["anchor_failed"] and s["steps"] == 12
    assert "injected anchor fault" in r.stderr and "continues without anchor priors" in r.stderr


def test_wrong_process_count_is_a_clear_error(tmp_path):
    r = launch(3, tmp_path / "x", [*BASE, *CASES["mask + PowerSGD, 2 replicas x 2 stages"][1]])
    assert r.returncode != 0 and "needs 4 processes, but 3 were started" in r.stderr


def rank_of(process) -> int | None:
    """The rank a process of `thinpipe launch` runs, from its name in ps (``thinpipe rank R (...)``); None for the
    launcher's other processes (its fork server, multiprocessing's resource tracker)."""
    import psutil

    try:
        m = re.match(r"thinpipe rank (\d+) \(", " ".join(process.cmdline()))
    except psutil.Error:
        return None
    return int(m.group(1)) if m else None


class LiveJob:
    """A training job of one of CASES started by `thinpipe launch` (by default 4 ranks, running
    until killed).

    Nothing here blocks without a deadline: a thread collects the output, and every process of the
    job (torchrun starts each rank in its own session) is remembered and killed at the end."""

    def __init__(self, tmp_path, case="mask + PowerSGD, 2 replicas x 2 stages", steps=100000, *extra):
        import psutil

        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.nproc, case_args = CASES[case]
        self.folder = tmp_path / "f"
        args = [sys.executable, "-m", "thinpipe", "launch", "--nproc", str(self.nproc), "--", "train", "--out",
                str(self.folder), *BASE, *case_args, "--set", f"train.steps={steps}", *extra]
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.out: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.job = psutil.Process(self.proc.pid)
        self.everyone: set = set()

    def _read(self):
        for line in iter(self.proc.stdout.readline, ""):
            self.out.append(line)

    @property
    def text(self) -> str:
        return "".join(self.out)

    def ranks(self):
        """The rank processes (below the launcher: forked by its server, each named ``thinpipe rank R (...)`` in
        ps, rank_starter.py) and the launcher itself. Every process below the launcher is remembered."""
        kids = self.job.children(recursive=True)
        self.everyone.update(kids)
        return [k for k in kids if rank_of(k) is not None], [self.job]

    def wait_until_training(self, timeout_s=180):
        deadline = time.time() + timeout_s
        while self.text.count("[thinpipe rank") < self.nproc:
            assert self.proc.poll() is None, "the job ended before every rank started:\n" + self.text[-3000:]
            assert time.time() < deadline, (f"not every rank started within {timeout_s} s:\n"
                                            + self.text[:1500] + "\n...\n" + self.text[-1500:])
            time.sleep(0.2)
        time.sleep(3)
        ranks, agent = self.ranks()
        assert len(ranks) == self.nproc and len(agent) == 1, [k.cmdline() for k in ranks + agent]
        return ranks, agent[0]

    def survivors(self, timeout_s=60):
        """Wait until every process of the job is gone (or timeout_s passed); return those left."""
        import psutil

        deadline = time.time() + timeout_s
        while True:
            left = [p for p in self.everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not left or time.time() > deadline:
                return left
            time.sleep(0.2)

    def kill_all(self):
        import psutil

        for p in [*self.everyone, self.job]:
            try:
                p.kill()
            except psutil.Error:
                pass
        self.reader.join(timeout=10)


@pytest.mark.dist
def test_a_dead_stage_rank_stops_every_rank_quickly_and_is_named(tmp_path):
    """kill -9 one rank mid-run: every process is gone well within 60 s, and the output names the
    dead rank (the launcher's root cause, with its role) and every rank's role (start-up lines)."""
    job = LiveJob(tmp_path)
    try:
        ranks, _ = job.wait_until_training()
        t0 = time.time()
        os.kill(max(r.pid for r in ranks), signal.SIGKILL)
        try:
            job.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        left = job.survivors(timeout_s=max(1.0, 60 - (time.time() - t0)))
        elapsed = time.time() - t0
    finally:
        job.kill_all()
    assert job.proc.returncode not in (None, 0) and not left and elapsed < 60, (left, job.text[-3000:])
    assert "Root Cause" in job.text and "SIGKILL" in job.text
    assert "stage 1" in job.text and "fast replica" in job.text


@pytest.mark.dist
def test_ranks_exit_when_their_launcher_is_killed(tmp_path):
    """kill -9 the launcher (as a lost node's torchrun agent would die): its ranks, each in its own
    session, notice and exit within seconds instead of training on as orphans."""
    job = LiveJob(tmp_path)
    try:
        _, agent = job.wait_until_training()
        t0 = time.time()
        agent.kill()
        left = job.survivors(timeout_s=30)
        elapsed = time.time() - t0
    finally:
        job.kill_all()
    assert not left, f"ranks still running {elapsed:.0f} s after their launcher died: {left}"
    assert "its launcher" in job.text and "is gone" in job.text


def uninterrupted(out, args: list[str]) -> None:
    """The uninterrupted run a resumed dist job must equal, in the simulation (one thread, as the ranks): the
    real processes equal it bitwise (test_dist_equals_sim), and it costs no launch."""
    assert main(["train", "--out", str(out), "--quiet", *args]) == 0


@pytest.mark.dist
@pytest.mark.parametrize("case", ["tied Qwen2 + Streaming DiLoCo in flight, GPipe", "MAPL-VQ, 3 stages"])
def test_crash_and_resume_from_per_rank_checkpoints_continues_the_same_run(case, tmp_path, one_thread):
    nproc, args = CASES[case]
    args = [*BASE, *args, "--set", "train.steps=6", "--set", "train.checkpoint_every=3"]
    full, part = tmp_path / "full", tmp_path / "part"
    uninterrupted(full, args)
    crashed = launch(nproc, part, args, THINPIPE_FAULT_AT_STEP="4")
    assert crashed.returncode != 0 and "injected fault at step 4" in crashed.stderr
    r = launch(nproc, part, args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(part) == results(full)


@pytest.mark.dist
def test_a_crash_while_checkpointing_resumes_from_the_previous_complete_checkpoint(tmp_path, one_thread):
    nproc, args = CASES["mask + PowerSGD, 2 replicas x 2 stages"]
    args = [*BASE, *args, "--set", "train.steps=6", "--set", "train.checkpoint_every=2",
            "--set", "train.keep_checkpoints=1"]
    full, part = tmp_path / "full", tmp_path / "part"
    uninterrupted(full, args)
    crashed = launch(nproc, part, args, THINPIPE_FAULT_AT_CHECKPOINT="4")  # the last rank dies after writing step 4
    assert crashed.returncode != 0
    # no rank dropped step 2's part: that waits until every rank has written step 4's (the barrier)
    assert [s for s, _ in sets(part / "checkpoint")][-1] == 2
    r = launch(nproc, part, args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(part) == results(full)


@pytest.mark.dist
def test_a_run_with_an_anchor_circuit_killed_mid_way_resumes_bitwise(tmp_path, one_thread):
    """Issue 16: at the checkpoint of step 3 the priors of pulls 1 and 2 are in flight (due at 3 and
    4); the fast ranks hold them, the anchor ranks their data position and PowerSGD push state, so the
    resumed run equals the uninterrupted one in every loss, byte and staleness."""
    nproc, args = CASES["mask + AP + PowerSGD, 2 x 2 + anchor row"]
    args = [*BASE, *args, "--set", "train.steps=7", "--set", "train.checkpoint_every=3"]
    full, part = tmp_path / "full", tmp_path / "part"
    uninterrupted(full, args)
    crashed = launch(nproc, part, args, THINPIPE_FAULT_AT_STEP="4")
    assert crashed.returncode != 0 and "injected fault at step 4" in crashed.stderr
    assert sorted(p.name for p in (part / "checkpoint" / "step00000003").glob("*.sha256")) == \
        [f"rank{r}.sha256" for r in range(nproc)]
    ready = load_part(part / "checkpoint" / "step00000003", "rank0")["anchor"]["ready"]
    assert [p for p, _ in ready] == [1, 2]  # produced at steps 1 and 2, not yet consumed
    r = launch(nproc, part, args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(part) == results(full)
    assert results(full)[3]["priors_consumed"] == 5


@pytest.mark.dist
def test_ctrl_c_on_the_launcher_stops_every_rank(tmp_path):
    """SIGINT (Ctrl-C) to `thinpipe launch`: it stops every rank (each in its own session, so the
    terminal's signal reaches only the launcher), says so, and exits with 130."""
    job = LiveJob(tmp_path)
    try:
        job.wait_until_training()
        job.proc.send_signal(signal.SIGINT)
        job.proc.wait(timeout=60)
        left = job.survivors(timeout_s=30)
    finally:
        job.kill_all()
    assert job.proc.returncode == 130 and not left, (left, job.text[-2000:])
    assert "interrupted: stopping every rank" in job.text


@pytest.mark.dist
def test_a_killed_anchor_rank_leaves_the_fast_circuit_finishing(tmp_path):
    """kill -9 an anchor rank mid-run (``arrival`` delivery): the launcher warns instead of stopping
    the job, the fast ranks notice the broken link, and the run finishes with anchor_failed set."""
    job = LiveJob(tmp_path, "mask + AP + PowerSGD, 2 x 2 + anchor row", 200, "--set", "anchor.delivery=arrival")
    try:
        ranks, _ = job.wait_until_training()
        anchor = max(ranks, key=rank_of)  # rank 5: the anchor's stage 1
        anchor.kill()
        job.proc.wait(timeout=240)
    finally:
        job.kill_all()
    assert job.proc.returncode == 0, job.text[-3000:]
    s = json.loads((job.folder / "summary.json").read_text())
    assert s["steps"] == 200 and s["anchor_failed"], job.text[-3000:]
    assert "anchor rank 5 (stage 1) died with signal SIGKILL" in job.text
    assert "continues without anchor priors" in job.text


def _netns_available() -> bool:
    import shutil

    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = f"tpprobe{os.getpid()}"  # per process: parallel test workers probe at the same time
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


@pytest.mark.dist
@pytest.mark.skipif(not _netns_available(), reason="needs root and network namespaces")
def test_kernel_shaped_links_in_network_namespaces_change_the_speed_not_the_result(tmp_path, one_thread):
    """`launch --netns`: each rank in its own namespace, the PP link shaped by tc at 1 Mbit/s. The
    run equals the simulation bitwise, takes at least the link's transfer time per direction, and
    leaves no namespace behind."""
    args = [*BASE, "--set", "model.name=tiny-llama", "--set", "mesh.pp=2", "--set", "train.seq_len=64",
            "--set", "link.pp_mbps=1"]
    assert main(["train", "--out", str(tmp_path / "sim"), "--quiet", *args]) == 0
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "thinpipe", "launch", "--nproc", "2", "--netns", "--", "train", "--out",
                        str(tmp_path / "ns"), "--quiet", *args], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(tmp_path / "ns") == results(tmp_path / "sim")
    s = json.loads((tmp_path / "ns" / "summary.json").read_text())
    one_direction_s = max(s["pp_fwd_bytes"], s["pp_bwd_bytes"]) * 8 / 1e6
    assert s["wall_s"] >= 0.9 * one_direction_s, (s["wall_s"], one_direction_s)
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before


@pytest.mark.dist
@pytest.mark.skipif(not _netns_available(), reason="needs root and network namespaces")
def test_netns_launcher_names_a_failed_rank_and_cleans_up(tmp_path):
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    env = {**os.environ, "OMP_NUM_THREADS": "1", "THINPIPE_FAULT_AT_STEP": "1"}
    r = subprocess.run([sys.executable, "-m", "thinpipe", "launch", "--nproc", "2", "--netns", "--", "train", "--out",
                        str(tmp_path / "ns"), "--quiet", *BASE, "--set", "model.name=tiny-llama", "--set", "mesh.pp=2"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Root Cause: rank" in r.stderr and "fast replica 0" in r.stderr
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before


@pytest.mark.dist
def test_mapl_pca_start_in_dist_equals_the_simulation(tmp_path, one_thread):
    """The PCA start across ranks (residuals at each sender, SVD, broadcast) gives the simulation's
    projectors: the whole run agrees bitwise."""
    args = [*BASE, "--set", "model.name=tiny-llama", "--set", "mesh.pp=3", "--set", "mesh.dp=2",
            "--set", "boundary.kind=mapl", "--set", "boundary.rank=16", "--set", "boundary.init=pca",
            "--set", "boundary.pca_batches=2"]
    assert main(["train", "--out", str(tmp_path / "sim"), "--quiet", *args]) == 0
    r = launch(6, tmp_path / "dist", args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(tmp_path / "dist") == results(tmp_path / "sim")
    random = tmp_path / "random"
    assert main(["train", "--out", str(random), "--quiet", *args, "--set", "boundary.init=random"]) == 0
    assert results(random)[0][0] != results(tmp_path / "sim")[0][0]  # the start matters


@pytest.mark.dist
def test_ssn_basis_refresh_in_dist_matches_the_simulation(tmp_path, one_thread):
    """SSN with Grassmann refreshes on 2 replicas x 3 stages: bytes equal exactly; losses agree to
    1e-5 relative (dL/dU is summed up the pipeline, not in autograd's order)."""
    args = [*BASE, "--set", "model.name=tiny-llama", "--set", "mesh.pp=3", "--set", "mesh.dp=2",
            "--set", "boundary.kind=ssn", "--set", "boundary.rank=16", "--set", "boundary.ssn_refresh_every=2",
            "--set", "boundary.ssn_refresh_lr=0.5", "--set", "train.steps=5"]
    assert main(["train", "--out", str(tmp_path / "sim"), "--quiet", *args]) == 0
    r = launch(6, tmp_path / "dist", args)
    assert r.returncode == 0, r.stderr[-3000:]
    (dl, dv, db, _), (sl, sv, sb, _) = results(tmp_path / "dist"), results(tmp_path / "sim")
    assert db == sb and db["pp_params_bytes"] == 2 * 2 * 2 * 2 * 64 * 16 * 4  # 2 refreshes x dp x 2(pp-1) x U
    assert dl == pytest.approx(sl, rel=1e-5) and dv == pytest.approx(sv, rel=1e-5)


@pytest.mark.dist
def test_auto_split_gives_a_slowed_rank_fewer_layers(tmp_path):
    """mesh.split = auto on real processes, rank 1 slowed 4x (THINPIPE_SLOW_RANK, in its start-up measurement as in
    training): it takes 1 of tiny-llama's 4 layers; config.toml holds the split, summary.json the measurements, and
    ranks.jsonl and the summary name the slowed rank (benchmarks/uneven_split.py measures the step time gained)."""
    out = tmp_path / "d"
    r = launch(2, out, [*BASE, "--set", "model.name=tiny-llama", "--set", "mesh.pp=2", "--set", "mesh.split=auto"],
               THINPIPE_SLOW_RANK="1:4")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert load_config(out / "config.toml").mesh.split == s["split_auto"]["split"] == [3, 1]
    stage1 = [m for m in s["split_auto"]["measures"] if m["stage"] == 1][0]
    stage0 = [m for m in s["split_auto"]["measures"] if m["stage"] == 0][0]
    assert stage1["layer_s"] > 2 * stage0["layer_s"]
    assert s["slowest_rank"] == 1
