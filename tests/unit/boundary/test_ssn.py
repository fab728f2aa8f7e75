"""Subspace Networks baseline (MAPL App. A): confinement makes the boundary lossless."""

import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.boundary.link import receiver_forward, sender_forward
from thinpipe.boundary.ssn import confinement_error
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.optim.stiefel import stiefel_error
from thinpipe.rank.context import make_contexts


def ssn_cfg(**kw):
    base = dict(model__name="tiny-llama", mesh__pp=4, boundary__kind="ssn", boundary__rank=16,
                train__batch_size=2, train__seq_len=16, train__lr=1e-3)
    return config(**{**base, **kw})


def test_reconstruction_equals_the_input_on_confined_weights():
    mesh = SimMesh(tiny_model(), ssn_cfg())
    batch = tiny_batch(batch_size=2)
    ctx = make_contexts(batch, 1, 0, 0)[0]
    x = ctx.input_ids
    with torch.no_grad():
        for s, st in enumerate(mesh.replicas[0][:-1]):
            x = st(x, ctx)
            b = mesh.boundaries[s]
            _, payload = sender_forward(b, x, ctx)
            assert payload.tensors["z"].shape[-1] == 16
            _, x_hat = receiver_forward(b, payload, ctx, torch.float32)
            assert torch.allclose(x_hat, x, atol=1e-5 * x.abs().max())
            x = x_hat


def test_without_confinement_the_projection_loses_information():
    """The same check on the unconfined model fails: losslessness comes from the confinement."""
    model = tiny_model()
    mesh = SimMesh(model, ssn_cfg())
    ref = SimMesh(model, config(model__name="tiny-llama", mesh__pp=4))
    ctx = make_contexts(tiny_batch(batch_size=2), 1, 0, 0)[0]
    with torch.no_grad():
        x = ref.replicas[0][0](ctx.input_ids, ctx)
        _, payload = sender_forward(mesh.boundaries[0], x, ctx)
        _, x_hat = receiver_forward(mesh.boundaries[0], payload, ctx, torch.float32)
    assert (x_hat - x).norm() > 0.1 * x.norm()


def test_confinement_holds_through_training_and_the_grassmann_refresh():
    mesh = SimMesh(tiny_model(), ssn_cfg(boundary__ssn_refresh_every=3, boundary__ssn_refresh_lr=0.5))
    U0 = mesh.boundaries[0].basis.U.clone()
    losses = []
    for step in range(6):
        losses.append(mesh.train_step([tiny_batch(batch_size=2)]))
        U = mesh.boundaries[0].basis.U
        assert confinement_error(mesh.replicas[0], U, mesh.boundaries[0].token_fixed) < 1e-5
        assert not U.requires_grad
    U = mesh.boundaries[0].basis.U
    assert stiefel_error(U) < 1e-5 and not torch.allclose(U, U0, atol=1e-4)   # two refreshes moved it
    assert all(b.basis is mesh.boundaries[0].basis for b in mesh.boundaries)   # one shared basis
    assert mesh.meter.totals["pp_params"] == 2 * (2 * 3 * 64 * 16 * 4)        # 2 refreshes
    assert losses[-1] < losses[0]


def test_eval_runs_through_the_boundary_and_matches_the_dense_stages():
    """Lossless boundary: evaluating through it equals evaluating the same (confined) stages densely."""
    mesh = SimMesh(tiny_model(), ssn_cfg())
    mesh.train_step([tiny_batch(batch_size=2)])
    batch = tiny_batch(batch_size=2, seed=5)
    through, n = mesh.eval_loss(batch)
    ctx = make_contexts(batch, 1, 0, 0)[0]
    ctx.loss_scale = 1.0
    x = ctx.input_ids
    with torch.no_grad():
        for st in mesh.replicas[0]:
            x = st(x, ctx)
    assert abs(through - float(x)) < 1e-4 * abs(through)


def test_payload_bytes_equal_the_formula():
    mesh = SimMesh(tiny_model(), ssn_cfg(train__microbatches=2))
    mesh.train_step([tiny_batch(batch_size=2)])
    fwd, bwd = mesh.boundaries[0].expected_bytes(16, 4)
    assert fwd == 16 * (16 * 4 + 2) and bwd == 16 * 16 * 4        # r fp32 values (+ int16 id forward)
    assert mesh.meter.totals["pp_fwd"] == 3 * 2 * fwd and mesh.meter.totals["pp_bwd"] == 3 * 2 * bwd
