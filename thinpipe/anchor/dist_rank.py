"""The anchor circuit as processes: anchor stage ranks and the fast ranks' side of their links.

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
(``fixed`` delivery). The fast circuit waits for the anchor's queued cycles once per checkpoint. An
anchor rank that fails (an exception) logs it, sends the end message marked failed and leaves: the
fast circuit continues without priors (the spectral filter keeps its last basis) and says so.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from thinpipe.anchor.codec import decode_push, encode_pull, encode_push, load_pull, trained, wire_expect
from thinpipe.anchor.sim_circuit import run_anchor_pass, staleness_stats
from thinpipe.checkpoint import prune, save_part, step_dir
from thinpipe.comm import AXES, ByteMeter
from thinpipe.comm.header import Expect
from thinpipe.comm.payload import Payload
from thinpipe.comm.tags import AnchorCycle, Pull, Push
from thinpipe.console import say
from thinpipe.dp.powersgd import PowerSGDState
from thinpipe.placement import device_of, to_device

STOP = -1
CYCLE = Expect.exactly({"step": ((1,), torch.int64)})  # an anchor stage's cycle message to the next
CHECKPOINT = -2  # pull-link marker: save the anchor's part of set ``at`` after every earlier pull, then acknowledge


def _step_of(payload: Payload) -> int:
    return int(payload.tensors["step"][0])


@dataclass
class Arrived:
    produced_step: int
    grads: dict[str, torch.Tensor]


class AnchorFeed:
    """A fast rank's end of the anchor links: posts pulls (fast replica 0 only), receives pushes on
    a thread, hands priors to the optimizer step by the delivery rule."""

    def __init__(self, cfg, stage, replica: int, pull_transport, push_transport, meter: ByteMeter, wire_dtype,
                 agree=None, wait_timeout_s: float = 600.0):
        a = cfg.anchor
        self.staleness, self.every = a.staleness, a.every or a.staleness
        self.delivery, self.push_rank = a.delivery, a.push_rank
        self.stage, self.replica, self.meter, self.wire_dtype = stage, replica, meter, wire_dtype
        self.pull_transport, self.push_transport = pull_transport, push_transport
        self.agree = agree  # ``arrival``: (count) -> the count every replica of this stage has
        self.wait_timeout_s = wait_timeout_s
        # what a push carries: the gradients of the parameters that train, in stage order
        self.like = {n: p.detach() for n, p in stage.named_parameters() if p.requires_grad}
        self.inbox: queue.Queue = queue.Queue()
        self.ready: list[Arrived] = []
        self.ended = False
        self.anchor_failed = False
        self.anchor_bytes: dict[str, int] = {a_: 0 for a_ in AXES}
        self.staleness_seen: list[int] = []
        self.wait_s = 0.0
        self.pulls_skipped = 0
        self.acked = -1  # the newest checkpoint step the anchor has acknowledged
        self._thread = threading.Thread(target=self._receive, name="thinpipe-anchor-push", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            while True:
                payload = self.push_transport.recv(Push(self.replica, self.stage.index), wire_expect(self.stage))
                self.inbox.put(payload)
                if _step_of(payload) == STOP:
                    return
        except BaseException as e:  # the link broke: as an anchor that failed
            self.inbox.put(e)

    def maybe_pull(self, step: int) -> None:
        """At a cycle's start step, fast replica 0 sends this stage's weights w_step (unless the
        anchor has ended: its end message is taken first)."""
        if self.replica != 0 or step % self.every:
            return
        while self._take(block=False):
            pass
        if self.ended:
            return
        # At most one pull in flight (memory stays bounded). If the last one has not left yet (a
        # slow anchor link), ``arrival`` skips this cycle; ``fixed`` must run every cycle, so it waits.
        if self.delivery == "arrival" and not self.pull_transport.idle():
            self.pulls_skipped += 1
            return
        t0 = time.perf_counter()
        self.flush()
        self.wait_s += time.perf_counter() - t0
        flat = encode_pull(trained(self.stage), self.wire_dtype)
        self._send_pull({"step": torch.tensor([step]), "w": flat}, "anchor", flat.nbytes)

    def _send_pull(self, tensors: dict, axis, metered: int | None = None) -> None:
        try:
            self.pull_transport.send(Pull(self.stage.index), Payload(tensors), axis, metered=metered)
        except Exception as e:
            self._end(failed=True, why=f"a pull could not be sent ({e})")

    def flush(self) -> None:
        """Wait for the last pull to have left (at most one is in flight, so memory stays bounded);
        a broken link means the anchor is gone."""
        try:
            self.pull_transport.flush()
        except Exception as e:
            self._end(failed=True, why=f"a pull could not be delivered ({e})")

    def _take(self, block: bool) -> bool:
        """Move one message from the inbox to ``ready``; False when none (or the anchor ended)."""
        if self.ended:
            return False
        try:
            item = self.inbox.get(timeout=self.wait_timeout_s) if block else self.inbox.get_nowait()
        except queue.Empty:
            if block:
                raise RuntimeError(f"no anchor prior arrived within {self.wait_timeout_s:.0f} s: the anchor circuit "
                                   "is stuck or far too slow (anchor.delivery = fixed waits for each prior; raise "
                                   "anchor.staleness or use anchor.delivery = arrival)") from None
            return False
        if isinstance(item, BaseException):
            self._end(failed=True, why=f"its link broke ({item})")
            return False
        step = _step_of(item)
        if step == CHECKPOINT:
            self.acked = int(item.tensors["at"][0])
            return True
        if step == STOP:
            t = item.tensors
            self.anchor_bytes = {a_: int(v) for a_, v in zip(AXES, t["bytes"].tolist())}
            self._end(failed=bool(t["failed"][0]), why="it raised an error (see its rank's log)")
            return False
        self.ready.append(Arrived(step, decode_push(item.tensors, self.like, self.push_rank)))
        return True

    def _end(self, failed: bool, why: str) -> None:
        self.ended = True
        if failed and not self.anchor_failed:
            self.anchor_failed = True
            say(f"[thinpipe] warning: the anchor circuit's stage {self.stage.index} stopped: {why}; fast replica "
                f"{self.replica} continues without anchor priors (the spectral filter keeps its last basis)")

    def due(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The priors this rank's optimizer takes at ``step``."""
        if self.delivery == "fixed":
            produced = step - self.staleness
            if produced < 0 or produced % self.every:
                return []
            t0 = time.perf_counter()
            while not any(a.produced_step == produced for a in self.ready) and self._take(block=True):
                pass
            self.wait_s += time.perf_counter() - t0
            take = [a for a in self.ready if a.produced_step == produced]
            self.ready = [a for a in self.ready if a.produced_step > produced]
        else:
            while self._take(block=False):
                pass
            n = self.agree(len(self.ready)) if self.agree is not None else len(self.ready)
            take, self.ready = self.ready[:n], self.ready[n:]
        self.staleness_seen += [step - a.produced_step for a in take]
        return [a.grads for a in take]

    def checkpoint(self, step: int, complete: int) -> dict:
        """This rank's side of the checkpoint of ``step`` (module docstring): replica 0 sends the marker
        after its pulls; every replica takes pushes until the anchor's acknowledgement. ``complete``:
        the newest set every rank holds (the anchor drops its older parts as the fast ranks did)."""
        t0 = time.perf_counter()
        if self.replica == 0:
            while self._take(block=False):
                pass
            if not self.ended:
                self.flush()
                self._send_pull({"step": torch.tensor([CHECKPOINT]), "at": torch.tensor([step]),
                                 "complete": torch.tensor([complete])}, None)
        while not self.ended and self.acked < step:
            self._take(block=True)
        self.wait_s += time.perf_counter() - t0
        return self.state_dict()

    def state_dict(self) -> dict:
        return {"ready": [(a.produced_step, a.grads) for a in self.ready], "staleness_seen": list(self.staleness_seen),
                "wait_s": self.wait_s, "pulls_skipped": self.pulls_skipped, "ended": self.ended}

    def load_state_dict(self, state: dict) -> None:
        """A resumed run's priors that had arrived but were not yet due, and the counts so far. A set
        written after the anchor ended holds no anchor parts and is never resumed from."""
        device = device_of(self.stage)
        self.ready = [Arrived(int(p), {n: g.to(device) for n, g in grads.items()}) for p, grads in state["ready"]]
        self.staleness_seen = [int(x) for x in state["staleness_seen"]]
        self.wait_s, self.pulls_skipped = float(state["wait_s"]), int(state["pulls_skipped"])

    def summary(self) -> dict:
        """The simulation's keys, plus how long the fast circuit waited on the anchor (late priors, a
        pull that had not left), the pulls ``arrival`` skipped because the last one was still on its
        way, and whether the anchor failed."""
        return {**staleness_stats(self.staleness_seen), "anchor_delivery": self.delivery, "anchor_wait_s": self.wait_s,
                "anchor_failed": self.anchor_failed, "anchor_pulls_skipped": self.pulls_skipped}

    def finish(self, complete: int = -1) -> None:
        """End of training: replica 0 stops the anchor stage; every fast rank waits for its end
        message (priors still arriving are dropped), which carries the anchor rank's byte meter.
        ``complete``: the newest set every rank holds (the anchor drops its older parts)."""
        while self._take(block=False):
            pass
        if self.replica == 0 and not self.ended:
            self._send_pull({"step": torch.tensor([STOP]), "complete": torch.tensor([complete])}, None)
            self.flush()
        while self._take(block=True):
            pass
        self._thread.join(timeout=self.wait_timeout_s)


class AnchorStageRank:
    """An anchor replica's stage process: the loop of cycles (see the module docstring)."""

    def __init__(self, cfg, stage, worker, actions, layout, rank: int, pull_transport, push_transport, row_transport,
                 meter: ByteMeter, wire_dtype, data_from, folder=None):
        """``data_from(cycles)``: the anchor's batches from cycle ``cycles`` on; ``folder``: the run's
        checkpoint folder (None: no checkpoints)."""
        self.cfg, self.stage, self.worker, self.layout, self.rank = cfg, stage, worker, layout, rank
        self.order = [(stage.index, a) for a in actions]
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
                payload = self.pull_transport.recv(Pull(self.stage.index), wire_expect(self.stage))
                self.pulls.put(payload)
                if _step_of(payload) == STOP:
                    return
        except BaseException as e:
            self.pulls.put(e)

    def _next_pull(self, newest: bool) -> Payload:
        """The next pull in order, or with ``newest`` the latest one queued (the others skipped)."""
        item = self.pulls.get()
        while newest and isinstance(item, Payload) and _step_of(item) >= 0 and not self.pulls.empty():
            self.skipped += 1
            item = self.pulls.get()
        if isinstance(item, BaseException):
            raise RuntimeError(f"the pull link from fast replica 0 broke: {item}") from item
        return item

    def _pull_of(self, step: int) -> Payload:
        """The pull of ``step`` or the CHECKPOINT marker (older pulls were skipped by stage 0's choice)."""
        while True:
            item = self._next_pull(newest=False)
            s = _step_of(item)
            if s == step or s == STOP:
                return item
            if step != CHECKPOINT and (s > step or s == CHECKPOINT):
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

    def state_dict(self) -> dict:
        return {"cycles": self.cycles, "skipped": self.skipped, "push": self.push.state_dict() if self.push else None}

    def load_state_dict(self, state: dict, meter: dict) -> None:
        """Resume: the data position (cycles run), the push's error feedback, the byte meter."""
        self.cycles, self.skipped = int(state["cycles"]), int(state["skipped"])
        if self.push is not None:
            self.push.load_state_dict(state["push"])
        self.data = self.data_from(self.cycles)
        self.meter.totals.update(meter)

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
                    step = _step_of(pull)
                else:
                    step = _step_of(self.row_transport.recv(AnchorCycle(s - 1), CYCLE))
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
                if self.cycles == fault_at_cycle:
                    raise RuntimeError(f"THINPIPE_FAULT_ANCHOR_AT_CYCLE: injected anchor fault at cycle {self.cycles}")
                load_pull(trained(self.stage), pull.tensors["w"])
                batch = to_device(next(self.data), device_of(self.stage))
                grads = run_anchor_pass([self.worker], self.order, batch, step, self.cfg.train.microbatches,
                                        self.layout.dp)[0]
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
