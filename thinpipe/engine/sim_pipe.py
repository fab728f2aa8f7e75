"""The simulation's ``Pipe`` (``objective/pipe.py``): every replica's ranks of a ``SimMesh`` over its mailbox.

Forward-only passes and updates run through the ranks' own ``StageWorker``s (the training forward: the
numbers an update's forward computes); an update is ``SimMesh.update`` (the schedules, the phases in lockstep,
the anchor circuit and the diagnostic); the held-out loss is replica 0's ``rank/passes.py: heldout_pass`` in
lockstep; generation drives every rank of a replica through ``rank/generation.py`` (``sim_generate.py``).
"""

from __future__ import annotations

from thinpipe.engine.sim_generate import generate_on_mesh
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.objective.pipe import (
    GENERATE_BATCH,
    eval_worker,
    forward_only,
    forward_order,
    reference_worker,
)
from thinpipe.objective.registry import wants_reference


class SimPipe:
    holds_last = lead = measures = True

    def __init__(self, mesh: SimMesh, tokenizer):
        self.mesh, self.tokenizer = mesh, tokenizer
        self.device = mesh.device
        self.replicas = list(range(mesh.cfg.mesh.dp))
        self.eval_workers = [{rk.index: eval_worker(rk.stage, rk.replica, rk.in_boundary, rk.out_boundary, mesh.mailbox,
                                                    mesh.compute_dtype) for rk in row} for row in mesh.ranks]

        # an objective that needs a reference (ObjectiveSpec.needs_reference): a frozen copy of each replica's
        # starting stages, on dense boundaries
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

    def update(self, index, lr, ctxs, source):
        return self.mesh.update(index, lr, ctxs, source)

    def heldout(self, batches):
        return [self.mesh.eval_loss(b) for b in batches]

    def sum_stats(self, values):
        return list(values)
