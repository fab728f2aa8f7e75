"""``mesh.split = "auto"``: the layers per stage chosen from what each rank measures (issue 54).

A mesh of other people's machines is uneven; a balanced split makes the slowest machine's stage set the pace.
At the start every rank measures, at the run's own shapes (one microbatch), the forward + backward of one decoder
layer of the model and of its stage's ends (the first stage's embedding; the last stage's final norm, head and loss),
and its free memory against what a layer holds (``measure``). The ranks gather the measurements and each computes the
same split (``choose_split``: deterministic in the numbers) that minimises the slowest stage's time

    max over stages s of  n_s * layer_s + ends_s      (a stage's time: the slowest of its replicas)

subject to 1 <= n_s <= what stage s's memory holds, ties going to the split nearest the balanced one, then to the
one with fewer layers on the end stages (they also embed, or compute the head), as ``balanced_split`` does. The
simulation declares relative speeds instead (``mesh.speeds``): its stages' times are one measurement divided by
them, and the same function chooses. The run's ``config.toml`` holds the chosen list (a resumed run keeps it) and
``summary.json`` the measurements (``split_auto``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from thinpipe.config import ConfigError
from thinpipe.models.stages import balanced_split


@dataclass(frozen=True)
class Measure:
    """One rank's measurement (seconds per microbatch; bytes)."""

    layer_s: float
    """Forward + backward of one decoder layer."""
    ends_s: float
    """Forward + backward of its stage's ends beyond the layers (embedding; final norm, head and loss)."""
    free_bytes: float
    """Memory free for its stage (inf: not measured)."""
    layer_bytes: float
    """What one layer holds in training: weights, gradients and optimizer state of what trains, and one
    microbatch's saved activations times the microbatches in flight."""
    ends_bytes: float

    def as_list(self) -> list[float]:
        return [self.layer_s, self.ends_s, self.free_bytes, self.layer_bytes, self.ends_bytes]

    @classmethod
    def of_list(cls, v) -> "Measure":
        return cls(*(float(x) for x in v[:5]))


def choose_split(layers: int, stages: list[Measure]) -> list[int]:
    """The layers per stage minimising the slowest stage's ``n * layer_s + ends_s`` within each stage's memory
    (``stages[s]``: stage s's measurement, its replicas' slowest already taken); ties to the split nearest
    ``balanced_split``, then fewer layers on the end stages. A ConfigError when the memory cannot hold the model."""
    k = len(stages)
    if k > layers:
        raise ConfigError(f"mesh.pp = {k} stages but the model has only {layers} decoder layers")
    caps = []
    for m in stages:
        room = (m.free_bytes - m.ends_bytes) / m.layer_bytes if m.layer_bytes > 0 else float("inf")
        caps.append(max(0, min(layers, int(room))) if room != float("inf") else layers)
    if any(c < 1 for c in caps) or sum(caps) < layers:
        raise ConfigError(f"mesh.split = auto: the ranks' free memory holds {sum(caps)} of the model's {layers} layers "
                          f"(per stage {caps}): add memory, stages or LoRA, or set train.activation_checkpointing")
    balanced = balanced_split(layers, k)
    # best[s][n]: the best (slowest time, distance from balanced, layers on the end stages, split) for stages s..
    # holding n layers
    inf = (float("inf"), float("inf"), float("inf"), ())
    best = [[inf] * (layers + 1) for _ in range(k + 1)]
    best[k][0] = (0.0, 0.0, 0.0, ())
    for s in range(k - 1, -1, -1):
        m = stages[s]
        for n in range(layers + 1):
            for here in range(1, min(caps[s], n) + 1):
                rest = best[s + 1][n - here]
                if rest[0] == float("inf"):
                    continue
                end = here if s in (0, k - 1) else 0
                cand = (max(here * m.layer_s + m.ends_s, rest[0]), abs(here - balanced[s]) + rest[1], end + rest[2],
                        (here, *rest[3]))
                if cand < best[s][n]:
                    best[s][n] = cand
    return list(best[0][layers][3])


def stage_measures(measures: dict[tuple[int, int], Measure], pp: int) -> list[Measure]:
    """Per stage, the slowest of its replicas' measurements (``measures[(replica, stage)]``) and the least memory."""
    out = []
    for s in range(pp):
        ms = [m for (r, st), m in sorted(measures.items()) if st == s]
        out.append(Measure(max(m.layer_s for m in ms), max(m.ends_s for m in ms), min(m.free_bytes for m in ms),
                           max(m.layer_bytes for m in ms), max(m.ends_bytes for m in ms)))
    return out


def summary(split: list[int], measures: dict[tuple[int, int], Measure], source: str) -> dict:
    """``summary.json``'s ``split_auto``: the split, where the numbers came from, and each rank's measurement."""
    def finite(v: float) -> float | None:  # JSON has no infinity: memory not measured is null
        return v if math.isfinite(v) else None
    return {"split": split, "source": source,
            "measures": [{"replica": r, "stage": s, **{k: finite(v) for k, v in asdict(m).items()}}
                         for (r, s), m in sorted(measures.items())]}
