"""The fast ranks' end of the anchor circuit's links (``dist_rank.py``'s module docstring: the protocol): pulls
posted by fast replica 0, pushes received on a thread, priors handed to the optimizer by the delivery rule."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from thinpipe.anchor.anchor_pass import staleness_stats
from thinpipe.anchor.codec import decode_push, encode_pull, trained, wire_expect
from thinpipe.anchor.dist_rank import CHECKPOINT, ROLLBACK, STOP, step_of
from thinpipe.comm.meter import AXES, ByteMeter
from thinpipe.comm.payload import Payload
from thinpipe.comm.tags import Pull, Push
from thinpipe.console import say
from thinpipe.placement import device_of


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
        self.rollbacks = 0  # rollbacks asked of the anchor, and the newest it has acknowledged
        self.rolled_back = 0
        self._thread = threading.Thread(target=self._receive, name="thinpipe-anchor-push", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            while True:
                payload = self.push_transport.recv(Push(self.replica, self.stage.index), wire_expect(self.stage))
                self.inbox.put(payload)
                if step_of(payload) == STOP:
                    return
        except BaseException as e:  # the link broke: as an anchor that failed
            self.inbox.put(e)

    def maybe_pull(self, step: int, rows=None) -> None:
        """At a cycle's start step, fast replica 0 sends this stage's weights w_step (unless the
        anchor has ended: its end message is taken first), and ``rows()`` with them when given (the
        rows of the anchor's pass that travel: ``Objective.anchor_rows`` of DPO and GSPO)."""
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
        extra = rows() if rows is not None else {}
        self._send_pull({"step": torch.tensor([step]), "w": flat, **extra}, "anchor",
                        flat.nbytes + sum(t.nbytes for t in extra.values()))

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
        step = step_of(item)
        if step == CHECKPOINT:
            self.acked = int(item.tensors["at"][0])
            return True
        if step == ROLLBACK:
            self.rolled_back = int(item.tensors["n"][0])
            self.ready = []  # what arrived before belongs to the diverged trajectory
            return True
        if step == STOP:
            t = item.tensors
            self.anchor_bytes = {a_: int(v) for a_, v in zip(AXES, t["bytes"].tolist())}
            self._end(failed=bool(t["failed"][0]), why="it raised an error (see its rank's log)")
            return False
        if self.rolled_back < self.rollbacks:
            return True  # a push of the diverged trajectory: dropped
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

    def _marker(self, tensors: dict, acknowledged) -> None:
        """Replica 0 sends a pull-link marker after its pulls; every replica takes pushes until
        ``acknowledged()`` (the anchor's answer to it, or the anchor ended)."""
        t0 = time.perf_counter()
        if self.replica == 0:
            while self._take(block=False):
                pass
            if not self.ended:
                self.flush()
                self._send_pull(tensors, None)
        while not self.ended and not acknowledged():
            self._take(block=True)
        self.wait_s += time.perf_counter() - t0

    def checkpoint(self, step: int, complete: int) -> dict:
        """This rank's side of the checkpoint of ``step`` (module docstring): the CHECKPOINT marker, then pushes
        until the anchor's acknowledgement. ``complete``: the newest set every rank holds (the anchor drops its
        older parts as the fast ranks did)."""
        self._marker({"step": torch.tensor([CHECKPOINT]), "at": torch.tensor([step]),
                      "complete": torch.tensor([complete])}, lambda: self.acked >= step)
        return self.state_dict()

    def rollback(self, step: int) -> None:
        """Back to the checkpoint of ``step`` (``dist_rank.py``'s module docstring): the ROLLBACK marker, then
        pushes dropped until the anchor's acknowledgement. The caller then loads this rank's part
        (``load_state_dict``)."""
        self.rollbacks += 1
        self._marker({"step": torch.tensor([ROLLBACK]), "at": torch.tensor([step]),
                      "n": torch.tensor([self.rollbacks])}, lambda: self.rolled_back >= self.rollbacks)

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
