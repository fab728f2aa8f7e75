"""DiLoCo outer step: sign, identical global state across replicas, H = 1 reduces to data parallelism."""

import torch

from tests.helpers import drive
from thinpipe.comm.inprocess import InProcessGroup, Work
from thinpipe.comm.meter import ByteMeter
from thinpipe.dp.diloco import DiLoCoState, outer_step


class DoublingGroup:
    """A fake all-reduce that doubles its input (one member)."""

    size = 1

    def all_reduce(self, rank, tensor):
        tensor.mul_(2)
        w = Work()
        w._done = True
        return w


def test_sign_of_the_applied_outer_gradient():
    g0 = torch.tensor([1.0, 2.0, 3.0])
    local = torch.nn.Parameter(torch.tensor([1.5, 1.0, 3.0]))
    state = DiLoCoState([("w", g0.clone())], outer_lr=1.0, momentum=0.0)
    applied = {}
    orig = state.outer.step

    def spy():
        applied["grad"] = state.global_params["w"].grad.clone()
        orig()

    state.outer.step = spy
    drive([outer_step(state, [("w", local)], DoublingGroup(), 0, 1)])
    torch.testing.assert_close(applied["grad"], -2 * (torch.tensor([1.5, 1.0, 3.0]) - g0))
    # lr 1, no momentum: global <- global - 2 (global - local) ; local is reset to it
    torch.testing.assert_close(local.detach(), g0 - 2 * (g0 - torch.tensor([1.5, 1.0, 3.0])))


def test_replicas_hold_identical_global_weights_and_outer_state():
    torch.manual_seed(0)
    start = torch.randn(6, 4)
    states = [DiLoCoState([("w", start)]) for _ in range(3)]
    locals_ = [torch.nn.Parameter(start + 0.1 * torch.randn(6, 4)) for _ in range(3)]
    group = InProcessGroup(3, ByteMeter(), "dp")
    for _ in range(2):
        drive([outer_step(s, [("w", p)], group, r, 3) for r, (s, p) in enumerate(zip(states, locals_))])
        for s, p in zip(states[1:], locals_[1:]):
            assert torch.equal(s.global_params["w"], states[0].global_params["w"])
            assert torch.equal(p, locals_[0])
            buf = s.outer.state[s.global_params["w"]]["momentum_buffer"]
            assert torch.equal(buf, states[0].outer.state[states[0].global_params["w"]]["momentum_buffer"])
        with torch.no_grad():
            for p in locals_:
                p.add_(0.05 * torch.randn(6, 4))


def test_h1_outer_sgd_lr1_no_momentum_equals_data_parallel():
    """Inner SGD for one step per replica, then the outer step == averaging the gradients (plain DP)."""
    torch.manual_seed(1)
    w0 = torch.randn(5, 3)
    grads = [torch.randn(5, 3) for _ in range(2)]
    lr = 0.1
    dp = w0 - lr * (grads[0] + grads[1]) / 2
    states = [DiLoCoState([("w", w0)], outer_lr=1.0, momentum=0.0) for _ in range(2)]
    locals_ = [torch.nn.Parameter(w0 - lr * g) for g in grads]  # one inner SGD step each
    group = InProcessGroup(2, ByteMeter(), "dp")
    drive([outer_step(s, [("w", p)], group, r, 2) for r, (s, p) in enumerate(zip(states, locals_))])
    torch.testing.assert_close(locals_[0].detach(), dp)
    torch.testing.assert_close(locals_[1].detach(), dp)
