"""Fault injection for the tests, read in this one module and nowhere else.

Each variable makes a process fail on purpose at one point, so the tests (and the measured elastic run)
can show that a crash loses nothing: a checkpoint set is whole or ignored, ``--resume`` continues the
same trajectory, a killed replica rejoins. Unset, each is inert; production never sets them.
docs/reliability.md lists them beside the tests that use them.

| variable | effect |
|---|---|
| ``THINPIPE_FAULT_AT_STEP=N`` | a dist rank raises at the start of step N |
| ``THINPIPE_FAULT_AT_CHECKPOINT=N`` | the last fast rank raises while writing the checkpoint set of step N |
| ``THINPIPE_FAULT_ANCHOR_AT_CYCLE=N`` | the last anchor rank raises at its cycle N |
| ``THINPIPE_TEST_NAN_AT_STEP=N`` | the run loop sees a NaN loss at step N, once (divergence handling) |
| ``THINPIPE_TEST_KILL_IN_CHECKPOINT_WRITE=N`` | SIGKILL half-way through writing the set of step N |
| ``THINPIPE_ELASTIC_KILL=r:s:N`` | the elastic rank (replica r, stage s) SIGKILLs itself mid-step N |
| ``THINPIPE_BENCH_WHOLE_MODEL=1`` | a dist rank loads the whole model first (benchmarks/stage_memory.py's "before") |
| ``THINPIPE_SLOW_RANK=r:factor`` | global rank r computes ``factor`` times as long (``rank/timing.py``) |
"""

from __future__ import annotations

import os

from thinpipe.config import ConfigError

FAULT_AT_STEP = "THINPIPE_FAULT_AT_STEP"
FAULT_AT_CHECKPOINT = "THINPIPE_FAULT_AT_CHECKPOINT"
FAULT_ANCHOR_AT_CYCLE = "THINPIPE_FAULT_ANCHOR_AT_CYCLE"
NAN_AT_STEP = "THINPIPE_TEST_NAN_AT_STEP"
KILL_IN_CHECKPOINT_WRITE = "THINPIPE_TEST_KILL_IN_CHECKPOINT_WRITE"
ELASTIC_KILL = "THINPIPE_ELASTIC_KILL"
BENCH_WHOLE_MODEL = "THINPIPE_BENCH_WHOLE_MODEL"
SLOW_RANK = "THINPIPE_SLOW_RANK"


def _step(name: str) -> int:
    """The step (or cycle) a variable names, -1 when unset."""
    value = os.environ.get(name, "").strip()
    if not value:
        return -1
    if not value.lstrip("-").isdigit():
        raise ConfigError(f"${name} = {value!r}: give a step number, e.g. 3 (a test-only variable: unset it)")
    return int(value)


def fault_at_step() -> int:
    return _step(FAULT_AT_STEP)


def fault_at_checkpoint() -> int:
    return _step(FAULT_AT_CHECKPOINT)


def fault_anchor_at_cycle() -> int:
    return _step(FAULT_ANCHOR_AT_CYCLE)


def nan_at_step() -> int:
    return _step(NAN_AT_STEP)


def kill_in_checkpoint_write() -> int:
    return _step(KILL_IN_CHECKPOINT_WRITE)


def elastic_kill_step(replica: int, stage: int) -> int:
    """``replica:stage:step``: the step at which the elastic rank (replica, stage) SIGKILLs itself, or -1."""
    kill = os.environ.get(ELASTIC_KILL, "")
    if not kill:
        return -1
    parts = kill.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"${ELASTIC_KILL} = {kill!r}: give replica:stage:step, e.g. 1:1:3")
    return int(parts[2]) if (int(parts[0]), int(parts[1])) == (replica, stage) else -1


def bench_whole_model() -> bool:
    return os.environ.get(BENCH_WHOLE_MODEL) == "1"


def slow_factor(rank: int) -> float:
    """``THINPIPE_SLOW_RANK=r:factor``'s factor for global rank ``rank`` (1.0: not this rank, or unset)."""
    value = os.environ.get(SLOW_RANK, "").strip()
    if not value:
        return 1.0
    r, _, factor = value.partition(":")
    try:
        which, f = int(r), float(factor)
    except ValueError:
        which, f = -1, 0.0
    if which < 0 or not f >= 1.0:
        raise ConfigError(f"${SLOW_RANK} = {value!r}: give rank:factor with factor >= 1, e.g. 2:3 (a test-only "
                          "variable: unset it)")
    return f if which == rank else 1.0
