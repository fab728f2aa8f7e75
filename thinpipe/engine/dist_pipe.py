"""A fast rank's ``Pipe`` (``rank/pipe.py``) on the real mesh: its own stage of its replica.

Forward-only passes and updates run this rank's row of the pass through its ``StageWorker`` (the training
worker on the training transport, metered; an eval worker, dense unless part of the model, on the evaluation
transport), an update's phases as ``DistEngine.compute_step`` runs them; generation runs this rank's
``rank/generation.py`` pass (``dist_generate.py``); statistics are summed over the fast ranks in one collective.
"""

from __future__ import annotations

import torch

from thinpipe.comm import AXES
from thinpipe.engine.dist_generate import generate_on_rank
from thinpipe.rank.pipe import (
    GENERATE_BATCH,
    eval_worker,
    forward_only,
    forward_order,
    reference_worker,
    wants_reference,
)
from thinpipe.rank.schedule import SCHEDULES, execute


class DistPipe:
    def __init__(self, engine, tokenizer):
        """``engine``: the rank's ``DistEngine`` (its stage, boundaries, transports, groups)."""
        self.e, self.tokenizer = engine, tokenizer
        self.device = engine.device
        self.replicas = [engine.role.replica]
        self.holds_last = engine.stage.is_last
        self.lead = engine.lead
        self.eval_worker = eval_worker(engine.stage, engine.role.replica, engine.in_b, engine.out_b,
                                       engine.eval_transport, engine.rk.worker.compute_dtype)

        # GSPO's KL: a frozen copy of this rank's starting stage on dense boundaries
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

    def update(self, index, lr, ctxs):
        e, rk = self.e, self.e.rk
        rows = ctxs[e.role.replica]
        s, pp = e.stage.index, e.cfg.mesh.pp
        rk.begin_step(index)
        with torch.enable_grad():
            execute([(s, a) for a in SCHEDULES[e.cfg.train.schedule](pp, len(rows))[s]], {s: rk.worker}, rows)
        for phase in rk.phases(index, lr, [], 0.0):
            for work in phase:
                work.wait()
        e.transport.flush()
        return sum(rk.worker.losses) if e.stage.is_last else 0.0

    def sum_stats(self, values):
        rows = self.e._gather(list(values))
        return [float(sum(float(r[i]) for r in rows)) for i in range(len(values))]

    def sync_meters(self) -> None:
        """The whole mesh's bytes and replica 0's gradient norm after a step (what ``DistEngine.train_step``
        gathers for SFT), in one collective."""
        e = self.e
        mine = e.meter.snapshot()
        rows = e._gather([e.rk.last_grad_norm, *(mine[a] for a in AXES)])
        e._bytes = {a: int(sum(float(r[1 + i]) for r in rows)) for i, a in enumerate(AXES)}
        e._grad_norm = float(rows[0][0])
