"""Pipeline schedules as data: one list of actions per stage (torchtitan style).

An action is ("F", microbatch) or ("B", microbatch). GPipe runs all forwards then all backwards;
1F1B (PipeDream-flush) warms up with P - s - 1 forwards, then alternates one forward and one
backward (steady state), then drains the remaining backwards (cool-down). Both run each stage's
backwards in microbatch order, so gradients accumulate identically and the numerics are equal.
"""

from __future__ import annotations

Action = tuple[str, int]


def gpipe(num_stages: int, microbatches: int) -> list[list[Action]]:
    return [[("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
            for _ in range(num_stages)]


def one_f_one_b(num_stages: int, microbatches: int) -> list[list[Action]]:
    rows = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, microbatches)
        row: list[Action] = [("F", m) for m in range(warmup)]           # warm-up
        f, b = warmup, 0
        while f < microbatches:                                          # steady state: 1F then 1B
            row += [("F", f), ("B", b)]
            f, b = f + 1, b + 1
        row += [("B", m) for m in range(b, microbatches)]               # cool-down
        rows.append(row)
    return rows


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def serial_order(rows: list[list[Action]]) -> list[tuple[int, Action]]:
    """A single-threaded execution order of all stages' actions that respects the data
    dependencies (F(s,m) after F(s-1,m); B(s,m) after B(s+1,m) and F(s,m)). Each stage's own
    order is kept, which is what fixes the numerics."""
    num_stages = len(rows)
    done: set[tuple[int, str, int]] = set()
    cursor = [0] * num_stages
    order: list[tuple[int, Action]] = []
    total = sum(len(r) for r in rows)
    while len(order) < total:
        progressed = False
        for s in range(num_stages):
            if cursor[s] == len(rows[s]):
                continue
            kind, m = rows[s][cursor[s]]
            if kind == "F":
                ready = s == 0 or (s - 1, "F", m) in done
            else:
                ready = (s, "F", m) in done and (s == num_stages - 1 or (s + 1, "B", m) in done)
            if ready:
                order.append((s, (kind, m)))
                done.add((s, kind, m))
                cursor[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks: {rows}")
    return order


def execute(order: list[tuple[int, Action]], workers: dict, ctxs: list) -> None:
    """Walk ``order`` (``(stage, action)`` pairs) over the ``workers`` that hold those stages (stage
    index -> ``rank/worker.py: StageWorker``), microbatch ``m``'s actions on ``ctxs[m]``.

    The one executor: the simulation passes every stage of a replica and ``serial_order``'s order, a
    real rank its own stage and row, the anchor circuit either. Each worker's ``losses`` start empty,
    so after the walk the last stage's worker holds this pass's microbatch losses.
    """
    for w in workers.values():
        w.losses.clear()
    for s, (kind, mb) in order:
        w = workers[s]
        if kind == "F":
            w.forward(ctxs[mb])
        else:
            w.backward(ctxs[mb])
