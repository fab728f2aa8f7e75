"""The paper's closed-form throughput and staleness model (anchor-priors paper, App. J.1 and H.1-H.4).

Plain functions of explicit quantities, in the paper's symbols and units (bytes, bytes/s, s):
  K  pipeline stages          D  data-parallel replicas      N  parameters
  S  tokens per optimizer step of one replica                 H  hidden size
  b_act, b_grad  bytes per activation / gradient element
  rho_act  fraction of activation values sent (1 - p for masking)
  rho_dp   fraction of gradient bytes sent per sync (1/64 for the paper's PowerSGD)
  tau      optimizer steps per DP sync (DiLoCo's H)
  B        link bandwidth, bytes/s (the paper puts every transfer on one link of this rate)

App. J.1 counts all PP traffic of a step and the whole model's all-reduce as crossing one link of
bandwidth B, one after the other: a deliberately simple, pessimistic model (a real pipeline has
one link per boundary working at once); the schedule-level simulation refines it.
"""

from __future__ import annotations


def t_pp_s(K: int, S: float, H: int, b_act: float, rho_act: float, B: float) -> float:
    """App. J.1: T_PP = 2 (K-1) S H b_act rho_act / B (forward activations and backward gradients
    at each of the K-1 boundaries)."""
    _check_bandwidth(B)
    return 2 * (K - 1) * S * H * b_act * rho_act / B


def t_dp_s(D: int, N: float, b_grad: float, rho_dp: float, tau: float, B: float) -> float:
    """App. J.1: T_DP = 2 (D-1)/D N b_grad rho_dp / (B tau) (a ring all-reduce, amortised over tau
    steps); 0 for one replica."""
    _check_bandwidth(B)
    if D <= 1:
        return 0.0
    return 2 * (D - 1) / D * N * b_grad * rho_dp / (B * tau)


def step_time_s(t_compute: float, t_pp: float, t_dp: float, overlapped: bool) -> float:
    """App. J.1: max of the phases when they overlap (1F1B-style), their sum when they serialise."""
    return max(t_compute, t_pp, t_dp) if overlapped else t_compute + t_pp + t_dp


def t_compute_s(N: float, S: float, K: int, peak_flops: float, mfu: float) -> float:
    """One optimizer step's compute per replica: 6 N S FLOPs (forward + backward) spread over K
    stages working at once, at ``mfu`` of ``peak_flops`` each (the paper quotes ~100 ms for its
    setting at ~50% MFU without giving the formula)."""
    if peak_flops <= 0 or not 0 < mfu <= 1:
        raise ValueError(f"peak_flops must be > 0 and 0 < mfu <= 1, got {peak_flops}, {mfu}")
    return 6 * N * S / (K * peak_flops * mfu)


def t_pull_s(N: float, K: int, b_param: float, B: float) -> float:
    """App. H.2: an anchor stage pulls its shard of the weights, N/K parameters."""
    _check_bandwidth(B)
    return N / K * b_param / B


def t_push_s(push_bytes_per_stage: float, B: float) -> float:
    """App. H.2: the anchor stage pushes its (compressed) gradient."""
    _check_bandwidth(B)
    return push_bytes_per_stage / B


def k_stale(t_pull: float, t_clean: float, t_push: float, t_mask: float, overlap: bool = False) -> float:
    """App. H.1 / H.4: staleness of an anchor prior in fast (masked) steps,
    (T_pull + T_clean + T_push) / T_mask, or with the pull overlapped with the previous cycle,
    max(T_pull, T_clean + T_push) / T_mask."""
    if t_mask <= 0:
        raise ValueError(f"the masked step time must be > 0, got {t_mask}")
    cycle = max(t_pull, t_clean + t_push) if overlap else t_pull + t_clean + t_push
    return cycle / t_mask


def _check_bandwidth(B: float) -> None:
    if B <= 0:
        raise ValueError(f"link bandwidth must be > 0 bytes/s, got {B}: give every link a rate (Mbit/s)")
