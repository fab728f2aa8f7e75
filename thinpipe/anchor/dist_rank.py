"""The anchor circuit as processes: anchor stage ranks (the fast ranks' side of their links is ``feed.py``).

Paper §3 and App. H: one anchor replica (a row of the mesh, one process per stage) repeatedly
  pulls the fast circuit's weights w_t (fast replica 0's stage s -> anchor stage s),
  runs an unmasked forward-backward on its own data shard (dense boundaries, anchor-row links),
  pushes its gradient (dense or PowerSGD factors, ``anchor/codec.py``) to stage s of every fast replica,
off the fast circuit's critical path: the fast ranks post pulls and take priors from a queue that
a receiver thread fills, so they only ever wait in ``fixed`` delivery for a prior that is late.

Three kinds of link, each its own process group so that a thread blocked in a receive on one
never meets the main thread's traffic on another, all with a long timeout (an anchor cycle may
take longer than the fast circuit's collective timeout):
  pull group of stage s: {fast replica 0's stage s, anchor stage s}
  push group of stage s: {every fast replica's stage s, anchor stage s}
  anchor row group: the anchor's stage ranks (cycle numbers, activations, gradients)

Cycle order: anchor stage 0 picks the cycle (``fixed``: every pull in order, as the simulation
runs them; ``arrival``: the newest pull, older ones are skipped) and passes its step down the row
before the forward; the other stages take their own pull of that step. A stop (step -1) from the
fast side ends the loop; every anchor rank then sends an end message (its byte meter and whether
it failed) to its fast ranks.

Checkpoints (``thinpipe/checkpoint.py``, docs/reliability.md): at a checkpoint of step N, fast replica 0
sends a CHECKPOINT marker on each stage's pull link after its pulls of steps < N; the anchor runs
every cycle queued before it, saves its part ``rank{r}`` of the set (cycles run: its data position;
the PowerSGD push state; its byte meter) and acknowledges on the push link, and each fast rank takes
pushes until that acknowledgement, so the priors of every pull before N are in its own part (arrived,
not yet consumed) or consumed. Nothing is in flight in a set, and a resumed run continues bitwise
(``fixed`` delivery). The fast circuit waits for the anchor's queued cycles once per checkpoint.
A rollback (``train.on_divergence = rollback``) to set N: fast replica 0 sends a ROLLBACK marker after
its pulls; the anchor runs what was queued before it, loads its own part of set N and acknowledges on
the push links; each fast rank drops every push before that acknowledgement (they belong to the
diverged trajectory) and loads its part of N, so both circuits continue from N as the simulation does. An
anchor rank that fails (an exception) logs it, sends the end message marked failed and leaves: the
fast circuit continues without priors (the spectral filter keeps its last basis) and says so.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import traceback

import torch

from thinpipe.anchor.anchor_pass import run_anchor_pass
from thinpipe.anchor.codec import encode_push, load_pull, trained, wire_expect
from thinpipe.checkpoint import load_part, prune, save_part, step_dir
from thinpipe.comm.header import Expect
from thinpipe.comm.meter import AXES, ByteMeter
from thinpipe.comm.payload import Payload
from thinpipe.comm.tags import AnchorCycle, Pull, Push
from thinpipe.console import say
from thinpipe.dp.powersgd import PowerSGDState
from thinpipe.objective.registry import anchor_contexts, anchor_rows_bytes, check_anchor_rows
from thinpipe.placement import device_of
from thinpipe.rank.schedule import SCHEDULES

STOP = -1
CYCLE = Expect.exactly({"step": ((1,), torch.int64)})  # an anchor stage's cycle message to the next
CHECKPOINT = -2  # pull-link marker: save the anchor's part of set ``at`` after every earlier pull, then acknowledge
ROLLBACK = -3    # pull-link marker: after every earlier pull, load the anchor's part of set ``at``, then acknowledge


def step_of(payload: Payload) -> int:
    return int(payload.tensors["step"][0])


class AnchorStageRank:
    """An anchor replica's stage process: the loop of cycles (see the module docstring)."""

    def __init__(self, cfg, stage, worker, layout, rank: int, pull_transport, push_transport, row_transport,
                 meter: ByteMeter, wire_dtype, data_from, vocab: int, folder=None):
        """``data_from(cycles)``: the anchor's batches of its own shard from cycle ``cycles`` on (SFT);
        ``vocab``: the model's vocabulary (token ids of rows a pull carries must fit it); ``folder``: the
        run's checkpoint folder (None: no checkpoints)."""
        self.cfg, self.stage, self.worker, self.layout, self.rank = cfg, stage, worker, layout, rank
        self.vocab = vocab
        self.rows_bytes = anchor_rows_bytes(cfg)  # 0: the anchor reads its own shard
        self.pull_transport, self.push_transport, self.row_transport = pull_transport, push_transport, row_transport
        self.meter, self.wire_dtype, self.data_from, self.folder = meter, wire_dtype, data_from, folder
        self.data = data_from(0)
        self.push = (PowerSGDState(rank=cfg.anchor.push_rank, start_step=0, seed=cfg.train.seed + stage.index)
                     if cfg.anchor.push_rank else None)
        self.pulls: queue.Queue = queue.Queue()
        self.cycles = 0
        self.skipped = 0
        self._receiver = threading.Thread(target=self._receive_pulls, name="thinpipe-anchor-pull", daemon=True)
        self._receiver.start()

    def close(self) -> None:
        for tr in (self.pull_transport, self.push_transport, self.row_transport):
            tr.close()

    def _receive_pulls(self) -> None:
        try:
            while True:
                payload = self.pull_transport.recv(Pull(self.stage.index), wire_expect(self.stage, self.rows_bytes))
                self.pulls.put(payload)
                if step_of(payload) == STOP:
                    return
        except BaseException as e:
            self.pulls.put(e)

    def _next_pull(self, newest: bool) -> Payload:
        """The next pull in order, or with ``newest`` the latest one queued (the others skipped)."""
        item = self.pulls.get()
        while newest and isinstance(item, Payload) and step_of(item) >= 0 and not self.pulls.empty():
            self.skipped += 1
            item = self.pulls.get()
        if isinstance(item, BaseException):
            raise RuntimeError(f"the pull link from fast replica 0 broke: {item}") from item
        return item

    def _pull_of(self, step: int) -> Payload:
        """The pull of ``step`` or a marker (older pulls were skipped by stage 0's choice)."""
        while True:
            item = self._next_pull(newest=False)
            s = step_of(item)
            if s == step or s == STOP:
                return item
            if step >= 0 and (s > step or s < 0):
                raise RuntimeError(f"anchor stage {self.stage.index}: cycle {step} was chosen but its pull is missing")

    # checkpoints (module docstring) ---------------------------------------------------------------
    def _prune(self, marker: Payload) -> None:
        """Drop this rank's parts of the sets the fast ranks dropped once set ``complete`` was whole."""
        complete = int(marker.tensors["complete"][0])
        if self.folder is not None and complete >= 0:
            prune(self.folder, self.cfg.train.keep_checkpoints, [f"rank{self.rank}"], upto=complete)

    def _checkpoint(self, marker: Payload) -> None:
        at = int(marker.tensors["at"][0])
        if self.folder is not None:
            save_part(step_dir(self.folder, at), f"rank{self.rank}", {
                "step": at, "world_size": self.layout.world_size, "role": self.layout.role(self.rank).__dict__,
                "anchor_rank": self.state_dict(), "bytes": self.meter.snapshot()})
        self._prune(marker)
        for r in range(self.layout.dp):
            self.push_transport.send(Push(r, self.stage.index), Payload({"step": torch.tensor([CHECKPOINT]),
                                                                         "at": torch.tensor([at])}), None)
        self.push_transport.flush()

    def _rollback(self, marker: Payload) -> None:
        """The fast circuit rolled back to the checkpoint of step ``at`` (``train.on_divergence = rollback``):
        every cycle queued before the marker has run (its pushes are dropped by the fast ranks), this rank goes
        back to its part of that set (its data position, the push's error feedback, its byte meter), then
        acknowledges on every push link."""
        at = int(marker.tensors["at"][0])
        state = load_part(step_dir(self.folder, at), f"rank{self.rank}")
        self.load_state_dict(state["anchor_rank"], state["bytes"])
        for r in range(self.layout.dp):
            self.push_transport.send(Push(r, self.stage.index), Payload({"step": torch.tensor([ROLLBACK]),
                                                                         "n": marker.tensors["n"]}), None)
        self.push_transport.flush()

    def state_dict(self) -> dict:
        return {"cycles": self.cycles, "skipped": self.skipped, "push": self.push.state_dict() if self.push else None}

    def load_state_dict(self, state: dict, meter: dict) -> None:
        """Resume: the data position (cycles run), the push's error feedback, the byte meter."""
        self.cycles, self.skipped = int(state["cycles"]), int(state["skipped"])
        if self.push is not None:
            self.push.load_state_dict(state["push"])
        self.data = self.data_from(self.cycles)
        self.meter.totals.update(meter)

    def _pass(self, step: int, pull: Payload) -> dict[str, torch.Tensor]:
        """The unmasked pass of this cycle on its rows (its own shard, or those the pull carried, checked first):
        this stage's gradient."""
        if self.rows_bytes:
            rows = {k: v for k, v in pull.tensors.items() if k not in ("step", "w")}
            check_anchor_rows(self.cfg, rows, self.vocab)
        else:
            rows = next(self.data)
        ctxs = anchor_contexts(self.cfg, rows, step, self.layout.dp, device_of(self.stage))
        s, pp = self.stage.index, self.layout.pp
        order = [(s, a) for a in SCHEDULES[self.cfg.train.schedule](pp, len(ctxs))[s]]
        return run_anchor_pass([self.worker], order, ctxs)[0]

    def run(self, fault_at_cycle: int = -1) -> None:
        """Cycles until the fast circuit's stop. After a failure this process leaves at once
        (``os._exit``): its receiver thread is blocked in a receive that no clean shutdown of the
        process groups would survive."""
        s, last = self.stage.index, self.stage.is_last
        failed = False
        try:
            while True:
                if self.stage.is_first:
                    pull = self._next_pull(newest=self.cfg.anchor.delivery == "arrival")
                    step = step_of(pull)
                else:
                    step = step_of(self.row_transport.recv(AnchorCycle(s - 1), CYCLE))
                    pull = self._pull_of(step)  # at a stop: this stage's own stop (its receiver is done)
                if not last:
                    self.row_transport.send(AnchorCycle(s), Payload({"step": torch.tensor([step])}), None)
                if step == STOP:
                    self.row_transport.flush()  # the next stage's stop must have left before teardown
                    self._prune(pull)
                    break
                if step == CHECKPOINT:
                    self._checkpoint(pull)
                    continue
                if step == ROLLBACK:
                    self._rollback(pull)
                    continue
                if self.cycles == fault_at_cycle:
                    raise RuntimeError(f"THINPIPE_FAULT_ANCHOR_AT_CYCLE: injected anchor fault at cycle {self.cycles}")
                load_pull(trained(self.stage), pull.tensors["w"])
                grads = self._pass(step, pull)
                push = encode_push(grads, self.push, self.wire_dtype)
                nbytes = sum(t.nbytes for t in push.values())
                for r in range(self.layout.dp):
                    self.push_transport.send(Push(r, self.stage.index), Payload({"step": torch.tensor([step]), **push}),
                                             "anchor", metered=nbytes)
                self.push_transport.flush()
                self.row_transport.flush()
                self.cycles += 1
        except Exception:
            failed = True
            say(f"[thinpipe rank anchor stage {s}] the anchor circuit failed; the fast circuit goes on without it:\n"
                + traceback.format_exc())
        meter = torch.tensor([self.meter.totals[a] for a in AXES], dtype=torch.int64)
        try:
            for r in range(self.layout.dp):
                self.push_transport.send(Push(r, self.stage.index),
                                         Payload({"step": torch.tensor([STOP]), "bytes": meter,
                                                  "failed": torch.tensor([int(failed)])}), None)
            self.push_transport.flush()
            if not failed:
                self._receiver.join()  # it has taken the stop: nothing is left blocked in a receive
        finally:
            if failed:
                sys.stderr.flush()
                os._exit(0)  # torchrun must not take this for the job's failure
