"""The objective contract is enough: an objective defined only in this file (its data, its loss, its own held-out
measure and its metrics, described by one ``ObjectiveSpec``) trains in the simulation and on real processes with
equal run files, and no engine or rank code knows it (the engines never name an objective).

The toy: next-token training with label smoothing (Szegedy et al. 2016, eps = 0.1), its held-out measure the
greedy next-token accuracy (a score, not a loss: ``val_top1``), and as a metric of each step the plain next-token
loss of the same forward (``nll``), which its loss function records on the last stage.
"""

import re
import shutil
from pathlib import Path

import pytest
import torch.nn.functional as F

from tests.helpers import assert_same_run_files, launch_with_plugin, run_files
from thinpipe.cli import main
from thinpipe.data import build_dataset
from thinpipe.objective.spec import ObjectiveSpec
from thinpipe.placement import to_device
from thinpipe.plugins import register_objective
from thinpipe.rank.context import make_contexts
from thinpipe.rank.from_config import anchor_stream, lr_at, replica_stream, val_batches

ROOT = Path(__file__).resolve().parents[2]
EPS = 0.1


def smoothed_loss(logits, ctx):
    """Label-smoothed next-token cross-entropy, summed over labelled positions and scaled like the next-token loss;
    records the plain next-token loss of the same logits (``nll``)."""
    logp = F.log_softmax(logits[:, :-1], dim=-1)
    target = ctx.labels[:, 1:]
    keep = target != -100
    nll = -logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per = (1 - EPS) * nll - EPS * logp.mean(-1)
    ctx.stats["nll"] = float((nll.detach() * keep).sum())
    return (per * keep).sum() * ctx.loss_scale


def record_top1(logits, ctx):
    target = ctx.labels[:, 1:]
    keep = target != -100
    ctx.stats["right"] = float(((logits[:, :-1].argmax(-1) == target) & keep).sum())
    ctx.stats["n"] = float(keep.sum())
    return logits.new_zeros(())


def contexts(batch, cfg, step, replica, device, loss_fn):
    ctxs = make_contexts(to_device(batch, device), cfg.train.microbatches, step, replica)
    for c in ctxs:
        c.loss_fn = loss_fn
    return ctxs


class Smoothed:
    """The toy objective over a ``Pipe`` (objective/base.py: Objective)."""

    anchor_local = True  # its anchor reads its own shard

    def __init__(self, cfg, pipe, train_ds, val_ds):
        self.cfg, self.pipe, self.train_ds, self.val_ds = cfg, pipe, train_ds, val_ds
        self.tokens, self.last = 0, {}
        self._streams, self._anchor = None, None

    def start(self):
        pass

    def residual_batches(self):
        return []

    def step(self, step):
        cfg, pipe = self.cfg, self.pipe
        if self._streams is None:
            self._streams = {r: replica_stream(cfg, self.train_ds, r, step) for r in pipe.replicas}
            self._anchor = anchor_stream(cfg, self.train_ds, step) if cfg.mesh.anchor else None
        ctxs = {r: contexts(next(s), cfg, step, r, pipe.device, smoothed_loss) for r, s in self._streams.items()}
        total = pipe.update(step, lr_at(cfg, step), ctxs, self)
        labelled = sum(int((c.labels[:, 1:] != -100).sum()) for cs in ctxs.values() for c in cs)
        nll = sum(c.stats.get("nll", 0.0) for cs in ctxs.values() for c in cs)
        mine = [total, float(len(ctxs)), nll, float(labelled)] if pipe.holds_last else [0.0] * 4
        loss_sum, replicas, nll_sum, n = pipe.sum_stats(mine)
        self.tokens += int(n)
        self.last = {"nll": nll_sum / max(n, 1.0)}
        return loss_sum / replicas

    def anchor_rows(self, index, ctxs):
        return next(self._anchor)

    def validation(self):
        mine = [0.0, 0.0]
        if self.pipe.measures:
            for batch in val_batches(self.val_ds, self.cfg.train.batch_size):
                ctxs = contexts(batch, self.cfg, 0, self.pipe.replicas[0], self.pipe.device, record_top1)
                self.pipe.forward(self.pipe.replicas[0], ctxs, "eval")
                if self.pipe.holds_last:
                    mine = [mine[0] + sum(c.stats["right"] for c in ctxs), mine[1] + sum(c.stats["n"] for c in ctxs)]
        right, n = self.pipe.sum_stats(mine)
        return right / max(n, 1.0)

    def validation_metrics(self):
        return {}

    def metrics(self):
        return dict(self.last)

    def state_dict(self):
        return {"tokens": self.tokens}

    def load_state_dict(self, state, step):
        self.tokens, self._streams = int(state["tokens"]), None


def toy_data(cfg, tokenizer):
    t, rows = cfg.train, cfg.data.val_rows
    train, val = (build_dataset(cfg.data.name, tokenizer, t.seq_len, split, t.seed) for split in ("train", "val"))
    val.input_ids, val.labels, val.segment_ids = val.input_ids[:rows], val.labels[:rows], val.segment_ids[:rows]
    return train, val


SPEC = ObjectiveSpec(
    name="toy-smoothed", build=lambda cfg, pipe, train, val, tok, bounds: Smoothed(cfg, pipe, train, val),
    data=toy_data, val_key="val_top1", val_is_loss=False, loss_label="smoothed loss", val_label="held-out top-1",
    anchor_contexts=lambda cfg, rows, index, tag, device: contexts(rows, cfg, index, tag, device, smoothed_loss))
register_objective(SPEC)

ARGS = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "train.steps=4",
        "--set", "train.batch_size=2", "--set", "train.seq_len=32", "--set", "train.microbatches=2",
        "--set", "train.lr=3e-3", "--set", "train.checkpoint_every=2", "--set", "eval.every=2", "--set", "mesh.pp=2",
        "--set", "mesh.dp=2", "--set", "boundary.kind=mask", "--set", "boundary.p=0.5",
        "--set", "train.objective=toy-smoothed"]


def check_toy_run(folder: Path) -> None:
    rows, summary = run_files(folder)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["nll"] > 0 for r in rows) and rows[-1]["nll"] < rows[0]["nll"]
    assert [("val_top1" in r) for r in rows] == [False, True, False, False]  # every 2 steps, not after the last
    assert 0 <= summary["final_val_top1"] <= 1 and "initial_val_top1" in summary
    assert "val_ppl" not in summary and "final_val_loss" not in summary  # its measure is a score, not a loss
    assert summary["objective"] == "toy-smoothed"
    assert (folder / "loss.png").is_file()


def test_the_toy_objective_trains_in_the_simulation_and_reports_its_own_measure(tmp_path):
    assert main(["train", "--out", str(tmp_path / "sim"), "--quiet", *ARGS]) == 0
    check_toy_run(tmp_path / "sim")


@pytest.mark.slow
def test_a_resumed_toy_run_continues_the_same_trajectory(tmp_path):
    """Its state (tokens) and data position come back through ``state_dict``: resume == uninterrupted."""
    whole = tmp_path / "whole"
    assert main(["train", "--out", str(whole), "--quiet", *ARGS]) == 0
    part = tmp_path / "part"
    assert main(["train", "--out", str(part), "--quiet", *ARGS, "--set", "train.steps=4",
                 "--set", "train.checkpoint_every=2"]) == 0
    shutil.rmtree(part / "checkpoint" / "step4", ignore_errors=True)  # keep the step-2 set only: resume from it
    (part / "summary.json").unlink()
    assert main(["train", "--out", str(part), "--quiet", "--resume"]) == 0
    assert_same_run_files(whole, part)


def test_no_engine_or_rank_names_an_objective():
    """Everything the engines and ranks need of an objective they ask its spec (objective/spec.py)."""
    names = re.compile(r"\b(sft|dpo|gspo)\b|reward_mean|val_accuracy", re.IGNORECASE)
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for folder in ("engine", "rank")
             for p in sorted((ROOT / "thinpipe" / folder).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if names.search(line)]
    assert not found, "\n".join(found)


def launch(nproc: int, out: Path, args: list[str]):
    return launch_with_plugin("tests.architecture.test_toy_objective", nproc, out, args)


@pytest.mark.dist
def test_the_toy_objective_on_real_processes_equals_the_simulation_file_by_file(tmp_path, one_thread):
    assert main(["train", "--out", str(tmp_path / "sim"), "--quiet", *ARGS]) == 0
    r = launch(4, tmp_path / "dist", ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    check_toy_run(tmp_path / "dist")
    assert_same_run_files(tmp_path / "sim", tmp_path / "dist")
