"""``ranks.jsonl``: where each rank's step time goes, one row per rank per step (issue 54).

A row: ``{"step", "rank", "replica", "stage", "compute_s", "wait_s": {neighbour rank: s}, "send_mbps":
{boundary: Mbit/s or null}}``. ``compute_s`` is the stage's forward and backward with its boundaries' codecs
(``rank/timing.py``); ``wait_s`` the time blocked receiving from each pipeline neighbour (activations from the
previous stage, gradients from the next); ``send_mbps`` what each link this rank sends on achieved, keyed by the
boundary's index (0 between stages 0 and 1): the bytes it carried over the seconds they spent on it
(``DistTransport.link_rates``), null for an unshaped link (its sends complete out of sight). The simulation's ranks
share one process: their compute is measured, their waits are 0 and no link is timed.

The summary names ``slowest_rank`` (the global rank with the most compute over the run) and ``slowest_link`` (the
boundary whose links achieved the fewest Mbit/s, or null when none was timed).
"""

from __future__ import annotations

import math

RANKS_FILE = "ranks.jsonl"
VECTOR = 5  # compute, wait on prev, wait on next, Mbit/s to next, Mbit/s to prev (NaN: none)


def rank_vector(times: tuple[float, float, float], rates: dict[int, tuple[float, float]], prev: int | None,
                nxt: int | None) -> list[float]:
    """One rank's step as the fixed-size vector the ranks gather (``rates``: its transport's ``link_rates``)."""
    def mbps(peer: int | None) -> float:
        if peer is None or peer not in rates or rates[peer][1] <= 0:
            return math.nan
        nbytes, seconds = rates[peer]
        return nbytes * 8 / seconds / 1e6
    return [*times, mbps(nxt), mbps(prev)]


def rows_of(step: int, vectors: dict[int, list[float]], grid: dict[int, list[int]]) -> list[dict]:
    """The step's rows from the ranks' vectors (``vectors[rank]``); ``grid[replica][stage]`` names the ranks (a
    replica whose ranks sent no vector is left out)."""
    out = []
    for replica, row in grid.items():
        for stage, rank in enumerate(row):
            if rank not in vectors:
                continue
            compute, wait_prev, wait_next, to_next, to_prev = vectors[rank][:VECTOR]
            waits, links = {}, {}
            if stage > 0:
                waits[str(row[stage - 1])] = wait_prev
                links[str(stage - 1)] = None if math.isnan(to_prev) else to_prev
            if stage < len(row) - 1:
                waits[str(row[stage + 1])] = wait_next
                links[str(stage)] = None if math.isnan(to_next) else to_next
            out.append({"step": step, "rank": rank, "replica": replica, "stage": stage, "compute_s": compute,
                        "wait_s": waits, "send_mbps": links})
    return out


def slowest(rows: list[dict]) -> dict:
    """``slowest_rank`` and ``slowest_link`` of a run's rows (None where the rows say nothing)."""
    compute: dict[int, float] = {}
    links: dict[int, list[float]] = {}
    for r in rows:
        compute[r["rank"]] = compute.get(r["rank"], 0.0) + r["compute_s"]
        for b, v in r["send_mbps"].items():
            if v is not None:
                links.setdefault(int(b), []).append(v)
    rank = max(sorted(compute), key=lambda k: compute[k]) if compute else None
    link = min(sorted(links), key=lambda b: sum(links[b]) / len(links[b])) if links else None
    return {"slowest_rank": rank, "slowest_link": link}
