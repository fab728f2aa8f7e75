"""Expected throughput of an elastic job whose replicas fail and come back (docs/elastic.md).

A first-order model of what one replica failure costs with ``thinpipe launch --elastic``
(failures rare against their cost, so at most one is handled at a time):

* every replica that survives stalls until the lighthouse declares the lost one gone
  (``detect_s`` = ``elastic.heartbeat_timeout_s``) and then redoes the step that failed
  (``step_s``): the whole job loses ``detect_s + step_s`` of its time;
* the lost replica is missing for ``max(detect_s, restart_s) + heal_s`` (its processes restart
  while the lighthouse waits, then it receives a peer's stage state over the DP link):
  the job trains at (D-1)/D of its rate meanwhile.

With D replicas failing independently every ``mtbf_s`` seconds each (failure rate D / mtbf_s):
  tokens/s = TPS x (1 - D/mtbf x (detect + step)) x (1 - 1/mtbf x (max(detect, restart) + heal))
Measured against it: experiments/elastic (a 5 s stall and a replica back 6.1 s after its SIGKILL).
"""

from __future__ import annotations


def heal_bytes(params: float, trained: float, stages: int, b_param: float, dp_state_bytes: int) -> float:
    """One stage's state a joiner receives: weights, AdamW's two fp32 moments of what trains, and
    the DP scheme's ``dp_state_bytes`` per trained parameter (``DPScheme.state_bytes_per_param``:
    DiLoCo's fp32 global copy and outer momentum, 8)."""
    return params / stages * b_param + trained / stages * (8 + dp_state_bytes)


def churn_tokens_per_s(tokens_per_s: float, step_s: float, replicas: int, mtbf_s: float, detect_s: float,
                       restart_s: float, heal_s: float) -> dict:
    if mtbf_s <= 0 or replicas < 1:
        raise ValueError("mtbf_s must be > 0 and replicas >= 1")
    stall = detect_s + step_s
    absent = max(detect_s, restart_s) + heal_s
    stalled = min(1.0, replicas / mtbf_s * stall)
    missing = min(1.0, absent / mtbf_s)
    return {"tokens_per_s": tokens_per_s * (1 - stalled) * (1 - missing), "stall_per_failure_s": stall,
            "replica_absent_per_failure_s": absent, "fraction_stalled": stalled, "fraction_replica_absent": missing,
            "failures_per_hour": replicas * 3600 / mtbf_s}
