"""The simulation's ``Pipe`` (``rank/pipe.py``): every replica's ranks of a ``SimMesh`` over its mailbox.

Forward-only passes and updates run through the ranks' own ``StageWorker``s (the training forward: the
numbers an update's forward computes), an update's phases in lockstep on every rank as ``SimMesh.train_step``
runs them; generation drives every rank of a replica through ``rank/generation.py`` (``sim_generate.py``).
"""

from __future__ import annotations

import torch

from thinpipe.comm import drive_lockstep
from thinpipe.engine.sim_generate import generate_on_mesh
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.rank.pipe import (
    GENERATE_BATCH,
    eval_worker,
    forward_only,
    forward_order,
    reference_worker,
    wants_reference,
)
from thinpipe.rank.schedule import SCHEDULES, execute, serial_order


class SimPipe:
    holds_last = lead = True

    def __init__(self, mesh: SimMesh, tokenizer):
        self.mesh, self.tokenizer = mesh, tokenizer
        self.device = mesh.device
        self.replicas = list(range(mesh.cfg.mesh.dp))
        self.eval_workers = [{rk.index: eval_worker(rk.stage, rk.replica, rk.in_boundary, rk.out_boundary, mesh.mailbox,
                                                    mesh.compute_dtype) for rk in row} for row in mesh.ranks]

        # GSPO's KL: a frozen copy of each replica's starting stages, on dense boundaries
        self.ref_workers = ([{rk.index: reference_worker(rk.stage, rk.replica, rk.in_boundary, rk.out_boundary,
                                                         mesh.mailbox, mesh.compute_dtype) for rk in row}
                             for row in mesh.ranks] if wants_reference(mesh.cfg) else None)

    def generate(self, replica, prompts, sampling, boundaries, row_keys, step, axis):
        return generate_on_mesh(self.mesh, prompts, sampling, self.tokenizer, replica=replica,
                                boundaries=boundaries, axis=axis, row_keys=row_keys, step=step,
                                batch_size=GENERATE_BATCH)

    def forward(self, replica, ctxs, boundaries):
        workers = {"train": self.mesh.workers, "eval": self.eval_workers, "reference": self.ref_workers}[boundaries][
            replica]
        forward_only(forward_order(self.mesh.cfg.mesh.pp, len(ctxs)), workers, ctxs)

    def update(self, index, lr, ctxs):
        mesh, pp = self.mesh, self.mesh.cfg.mesh.pp
        for rk in mesh.all_ranks():
            rk.begin_step(index)
        total = 0.0
        with torch.enable_grad():
            for r, rows in ctxs.items():
                execute(serial_order(SCHEDULES[mesh.cfg.train.schedule](pp, len(rows))), mesh.workers[r], rows)
                total += sum(mesh.workers[r][pp - 1].losses)
        phases = [rk.phases(index, lr, [], 0.0) for rk in mesh.all_ranks()]
        for i in range(len(phases[0])):
            drive_lockstep(ph[i] for ph in phases)
        mesh.last_grad_norm = mesh.ranks[0][0].last_grad_norm
        return total

    def sum_stats(self, values):
        return list(values)
