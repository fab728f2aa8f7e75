"""A fast rank's ``Pipe`` (``objective/pipe.py``) on the real mesh: its own stage of its replica.

Forward-only passes and updates run this rank's row of the pass through its ``StageWorker`` (the training worker on
the training transport, metered; an eval worker, dense unless part of the model, on the evaluation transport). An
update is the one place a real rank assembles one: the stage's row of the schedule, the anchor circuit's pull and
the priors due (``anchor/dist_rank.py: AnchorFeed``), every phase of ``StageRank``. Generation runs this rank's
``rank/generation.py`` pass (``dist_generate.py``); statistics are summed over the fast ranks in one collective
(an elastic replica's: over its own stages, its world).
"""

from __future__ import annotations

import torch

from thinpipe.engine.dist_generate import generate_on_rank
from thinpipe.objective.pipe import (
    GENERATE_BATCH,
    eval_worker,
    forward_only,
    forward_order,
    reference_worker,
)
from thinpipe.objective.registry import wants_reference
from thinpipe.rank.passes import heldout_pass
from thinpipe.rank.schedule import SCHEDULES, execute


class DistPipe:
    def __init__(self, engine, tokenizer):
        """``engine``: the rank's ``DistEngine`` (its stage, boundaries, transports, groups)."""
        self.e, self.tokenizer = engine, tokenizer
        self.device = engine.device
        self.replicas = [engine.data_replica]  # an elastic replica's world numbers its row 0: its job replica's data
        self.holds_last = engine.stage.is_last
        self.measures = engine.role.replica == 0
        self.lead = engine.lead
        self.eval_worker = eval_worker(engine.stage, engine.role.replica, engine.in_b, engine.out_b,
                                       engine.eval_transport, engine.rk.worker.compute_dtype)

        # an objective that needs a reference (ObjectiveSpec.needs_reference): a frozen copy of this rank's
        # starting stage on dense boundaries
        self.ref_worker = (reference_worker(engine.stage, engine.role.replica, engine.in_b, engine.out_b,
                                            engine.eval_transport, engine.rk.worker.compute_dtype)
                           if wants_reference(engine.cfg) else None)

    def generate(self, replica, prompts, sampling, boundaries, row_keys, step, axis):
        out = generate_on_rank(self.e, prompts, sampling, self.tokenizer, boundaries=boundaries, axis=axis,
                               row_keys=row_keys, step=step, batch_size=GENERATE_BATCH)
        self.e.transport.flush()
        return out

    def forward(self, replica, ctxs, boundaries):
        e = self.e
        worker, transport = {"train": (e.rk.worker, e.transport), "eval": (self.eval_worker, e.eval_transport),
                             "reference": (self.ref_worker, e.eval_transport)}[boundaries]
        s = e.stage.index
        forward_only(forward_order(e.cfg.mesh.pp, len(ctxs), [s]), {s: worker}, ctxs)
        transport.flush()

    def update(self, index, lr, ctxs, source):
        e, rk, cfg = self.e, self.e.rk, self.e.cfg
        rows = ctxs[self.replicas[0]]
        s = e.stage.index
        rk.begin_step(index)
        if e.feed is not None:  # w_t: the weights this update's forward uses (with the rows of the objective's pass)
            e.feed.maybe_pull(index, None if source.anchor_local else lambda: source.anchor_rows(index, ctxs))
        with torch.enable_grad():
            execute([(s, a) for a in SCHEDULES[cfg.train.schedule](cfg.mesh.pp, len(rows))[s]], {s: rk.worker}, rows)
        e.after_schedule(index)
        priors = e.feed.due(index) if e.feed is not None else []
        for phase in rk.phases(index, lr, priors, cfg.anchor.mix):
            for work in phase:
                work.wait()
        e.transport.flush()
        return sum(rk.worker.losses) if e.stage.is_last else 0.0

    def heldout(self, batches):
        e, out = self.e, []
        for _ in heldout_pass(e.stage, e.in_b, e.out_b, e.eval_transport, batches, e.rk.worker.compute_dtype,
                              e.step_index, out):
            pass
        return out

    def sum_stats(self, values):
        rows = self.e.gather(list(values))
        return [float(sum(float(r[i]) for r in rows)) for i in range(len(values))]
