"""PowerSGD math (Vogels et al. 2019) against its defining properties and PyTorch's own hook."""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ptpsgd

from tests.helpers import drive
from thinpipe.comm.inprocess import InProcessGroup
from thinpipe.comm.meter import ByteMeter
from thinpipe.dp.powersgd import PowerSGDState, orthonormalize, powersgd_average, wire_numel


def average(states, tensors_per_rank):
    world = len(states)
    group = InProcessGroup(world, ByteMeter(), "dp")
    drive(powersgd_average(s, t, group, r, world) for r, (s, t) in enumerate(zip(states, tensors_per_rank)))


def test_original_equals_approximation_plus_error():
    g = torch.Generator().manual_seed(0)
    M = torch.randn(12, 9, generator=g)
    state = PowerSGDState(rank=2, start_step=0)
    t = {"w": M.clone()}
    average([state], [t])
    torch.testing.assert_close(t["w"] + state.error["w"], M)
    assert torch.linalg.matrix_rank(t["w"]) == 2


def test_rank_one_matrix_reproduced_exactly():
    g = torch.Generator().manual_seed(1)
    M = torch.randn(10, 1, generator=g, dtype=torch.float64) @ torch.randn(1, 7, generator=g, dtype=torch.float64)
    for r in (1, 2):
        state = PowerSGDState(rank=r, start_step=0)
        t = {"w": M.clone()}
        average([state], [t])
        torch.testing.assert_close(t["w"], M)
        assert state.error["w"].abs().max() < 1e-12


def test_no_compression_before_start_step_and_vectors_never():
    g = torch.Generator().manual_seed(2)
    a = {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g)}
    b = {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g)}
    want = {k: (a[k] + b[k]) / 2 for k in a}
    states = [PowerSGDState(rank=1, start_step=1) for _ in range(2)]
    shapes = {k: tuple(v.shape) for k, v in a.items()}
    assert wire_numel(shapes, states[0]) == 8 * 6 + 6
    average(states, [a, b])
    for k in a:
        torch.testing.assert_close(a[k], want[k])
        torch.testing.assert_close(b[k], want[k])
    assert not states[0].error
    assert wire_numel(shapes, states[0]) == 1 * (8 + 6) + 6  # from step 1 on: r (n + m) + the vector


def test_workers_end_with_identical_average_and_q():
    g = torch.Generator().manual_seed(3)
    ranks = [{"w": torch.randn(16, 12, generator=g)} for _ in range(3)]
    states = [PowerSGDState(rank=2, start_step=0, seed=5) for _ in range(3)]
    for _ in range(3):  # warm-started steps
        average(states, ranks)
        assert torch.equal(ranks[0]["w"], ranks[1]["w"]) and torch.equal(ranks[0]["w"], ranks[2]["w"])
        assert torch.equal(states[0].q["w"], states[2].q["w"])


def test_orthonormalize():
    P = orthonormalize(torch.randn(20, 3, dtype=torch.float64))
    torch.testing.assert_close(P.T @ P, torch.eye(3, dtype=torch.float64))


class Bucket:
    """Duck-typed dist.GradBucket for PyTorch's hook (one bucket, index 0)."""

    def __init__(self, tensors):
        self._buffer = torch.cat([t.reshape(-1) for t in tensors])
        self._grads, offset = [], 0
        for t in tensors:
            self._grads.append(self._buffer[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def index(self):
        return 0

    def is_last(self):
        return True


def test_same_result_as_pytorch_powersgd_hook(tmp_path):
    """Oracle: PyTorch's DDP hook on a 1-process gloo group, warm-started from the same Qs."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(4)
        shapes = {"a": (12, 9), "b": (7, 15), "v": (9,)}
        pt_state = ptpsgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                        min_compression_rate=1, warm_start=True, use_error_feedback=True)
        mine = PowerSGDState(rank=2, start_step=2, min_compression_rate=1)
        for step in range(4):
            grads = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
            if step == 2:  # first compressed step: give both the same initial Qs
                qs = {k: mine.initial_q(k, shapes[k][1], 2, torch.float32) for k in ("a", "b")}
                pt_state.p_memory_dict[0] = torch.zeros(2 * (12 + 7))
                pt_state.q_memory_dict[0] = torch.cat([qs["a"].reshape(-1), qs["b"].reshape(-1)])
            bucket = Bucket([grads[k] for k in shapes])
            theirs = ptpsgd.powerSGD_hook(pt_state, bucket).wait()
            t = {k: v.clone() for k, v in grads.items()}
            average([mine], [t])
            torch.testing.assert_close(torch.cat([t[k].reshape(-1) for k in shapes]), theirs, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
