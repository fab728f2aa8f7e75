"""DP kinds in the mesh engine: bytes, replica consistency, reductions to simpler cases, resume."""

import copy
import math

import pytest
import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.engine.sim_mesh import SimMesh

KW = dict(model__name="tiny-llama", mesh__pp=2, mesh__dp=2, train__batch_size=2, train__lr=1e-3)


def steps(mesh, n, start=0):
    return [mesh.train_step([tiny_batch(2, seed=10 * s), tiny_batch(2, seed=10 * s + 1)]) for s in range(start, n)]


def replicas_equal(mesh):
    for s in range(len(mesh.replicas[0])):
        for a, b in zip(mesh.replicas[0][s].parameters(), mesh.replicas[1][s].parameters()):
            if not torch.equal(a, b):
                return False
    return True


def test_powersgd_sends_fewer_dp_bytes_and_keeps_replicas_identical():
    model = tiny_model("llama")
    exact = SimMesh(model, config(**KW))
    low = SimMesh(model, config(**KW, dp__kind="powersgd", dp__rank=2, dp__start_step=1))
    steps(exact, 3)
    steps(low, 3)
    assert replicas_equal(low)
    per_step_exact = exact.meter.totals["dp"] / 3
    # step 0 uncompressed (start_step = 1), steps 1-2 compressed
    assert low.meter.totals["dp"] < per_step_exact + 2 * per_step_exact / 2


def test_diloco_syncs_every_h_steps():
    mesh = SimMesh(tiny_model("llama"), config(**KW, dp__kind="diloco", dp__inner_steps=3, dp__rank=0))
    steps(mesh, 2)
    assert mesh.meter.totals["dp"] == 0 and not replicas_equal(mesh)  # replicas drift between syncs
    steps(mesh, 3, start=2)
    assert mesh.meter.totals["dp"] > 0 and replicas_equal(mesh)
    g = mesh.ranks[0][0].dp_scheme.state.global_params
    for n, p in mesh.replicas[0][0].named_parameters():
        assert torch.equal(p.detach(), g[n].detach())


def test_diloco_one_replica_outer_sgd_lr1_is_plain_training():
    model = tiny_model("llama")
    kw = dict(KW, mesh__dp=1)
    plain = SimMesh(model, config(**kw))
    dl = SimMesh(model, config(**kw, dp__kind="diloco", dp__inner_steps=2, dp__outer_lr=1.0, dp__outer_momentum=0.0,
                               dp__rank=0))
    a = [plain.train_step([tiny_batch(2, seed=s)]) for s in range(4)]
    b = [dl.train_step([tiny_batch(2, seed=s)]) for s in range(4)]
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


def test_dp_state_checkpoint_round_trip():
    model = tiny_model("llama")
    cfg = config(**KW, dp__kind="diloco", dp__inner_steps=2, dp__rank=2)
    full = SimMesh(model, cfg)
    ref = steps(full, 6)
    part = SimMesh(model, cfg)
    steps(part, 3)
    state = copy.deepcopy(part.state_dict())
    resumed = SimMesh(model, cfg)
    resumed.load_state_dict(state)
    assert steps(resumed, 6, start=3) == ref[3:]


@pytest.mark.parametrize("boundary", ["identity", "mask", "topk"])
@pytest.mark.parametrize("dp", [{}, {"dp__kind": "powersgd", "dp__start_step": 0},
                                {"dp__kind": "diloco", "dp__inner_steps": 2, "dp__rank": 2},
                                {"dp__kind": "streaming-diloco", "dp__inner_steps": 2, "dp__fragments": 2,
                                 "dp__overlap": 1, "dp__rank": 2},
                                {"dp__kind": "streaming-diloco", "dp__inner_steps": 2, "dp__quantize": True}])
@pytest.mark.parametrize("anchor", [0, 1])
def test_every_combination_runs(boundary, dp, anchor):
    """Any PP compressor x any DP scheme x anchor on/off, from config alone (DESIGN.md property 4)."""
    cfg = config(**KW, boundary__kind=boundary, boundary__p=0.5, mesh__anchor=anchor, anchor__staleness=1,
                 optim__spectral__rank=4, **dp)
    mesh = SimMesh(tiny_model("llama"), cfg)
    for s in range(3):
        loss = mesh.train_step([tiny_batch(2, seed=s), tiny_batch(2, seed=s + 5)], tiny_batch(2, seed=9))
        assert math.isfinite(loss), loss
    assert mesh.meter.totals["dp"] > 0 and (mesh.meter.totals["anchor"] > 0) == bool(anchor)
