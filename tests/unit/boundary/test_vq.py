"""Residual multi-codebook VQ and streaming codebook sync (MAPL §3.5, App. F)."""

import copy

import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.boundary.vq import StreamingCodebook, rvq_decode, rvq_encode, split_groups
from thinpipe.engine.sim_mesh import SimMesh


def test_round_trip_exact_on_codebook_sums_and_error_shrinks_with_rounds():
    g = torch.Generator().manual_seed(0)
    R, G, K, d = 2, 8, 16, 2
    books = torch.stack([torch.randn(G, K, d, generator=g) * 0.1 ** k for k in range(R)])
    codes = torch.randint(0, K, (50, 1, G), generator=g)
    u = rvq_decode(codes, books[:1])                          # vectors one round represents exactly
    assert torch.equal(rvq_encode(u, books[:1]), codes)
    assert torch.equal(rvq_decode(rvq_encode(u, books[:1]), books[:1]), u)
    assert rvq_encode(u, books).shape == (50, R, G) and int(rvq_encode(u, books).max()) < K
    x = split_groups(torch.randn(500, G * d, generator=g), d)
    one = (rvq_decode(rvq_encode(x, books[:1]), books[:1]) - x).norm()
    two = (rvq_decode(rvq_encode(x, books), books) - x).norm()
    assert two < one


def test_ema_learning_reduces_quantisation_error():
    vq = StreamingCodebook(rank=8, group_size=2, codes=16, rounds=2, sync_codes=16, decay=0.5, seed=0)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(400, 8, generator=g) * torch.tensor([3.0, 0.1] * 4)  # anisotropic: init codes fit it badly

    def err():
        codes, _ = vq.sender_encode(data, learn=False, sync=False)
        return float((rvq_decode(codes, vq.sender_shared).reshape(400, 8) - data).norm())

    before = err()
    for _ in range(10):
        vq.sender_encode(data, learn=True, sync=True)   # sync_codes = K: the whole codebook each time
    assert err() < 0.5 * before


def vq_cfg(**kw):
    base = dict(model__name="tiny-llama", mesh__pp=3, boundary__kind="mapl-vq", boundary__rank=16,
                boundary__vq_codes=32, boundary__vq_sync_codes=4, train__batch_size=2, train__seq_len=16,
                train__microbatches=2, train__lr=1e-3)
    return config(**{**base, **kw})


def test_sender_and_receiver_codebooks_agree_after_every_sync_and_bytes_match():
    mesh = SimMesh(tiny_model(), vq_cfg())
    for step in range(4):
        mesh.train_step([tiny_batch(batch_size=2, seed=step)])
        for b in mesh.boundaries:
            for vq in (b.fwd_vq, b.bwd_vq):
                assert int(vq.sent) == int(vq.received) == 2 * (step + 1)
                assert torch.equal(vq.sender_shared, vq.receiver_shared)
    b = mesh.boundaries[0]
    fwd, bwd = b.expected_bytes(16, 4)
    # per token: R * r/g uint8 codes + a fp32 scale (+ int16 id forward); per microbatch a slice of
    # R * r/g groups x 4 slots x g fp32 values
    slice_ = 2 * 8 * 4 * 2 * 4
    assert fwd == 16 * (2 * 8 + 4 + 2) + slice_ and bwd == 16 * (2 * 8 + 4) + slice_
    links = 2 * 4 * 2  # boundaries x steps x microbatches
    assert mesh.meter.totals["pp_fwd"] == links * fwd and mesh.meter.totals["pp_bwd"] == links * bwd


def test_evaluation_neither_learns_nor_syncs():
    mesh = SimMesh(tiny_model(), vq_cfg())
    mesh.train_step([tiny_batch(batch_size=2)])
    vq = mesh.boundaries[0].fwd_vq
    before = {k: v.clone() for k, v in vq.state_dict().items()}
    mesh.eval_loss(tiny_batch(batch_size=2, seed=9))
    assert all(torch.equal(before[k], v) for k, v in vq.state_dict().items())


def test_checkpoint_round_trip_continues_the_trajectory():
    model = tiny_model()
    a = SimMesh(model, vq_cfg())
    batches = [tiny_batch(batch_size=2, seed=s) for s in range(4)]
    for bt in batches[:2]:
        a.train_step([bt])
    state = copy.deepcopy(a.state_dict())  # as torch.save would: optimizers load state by reference
    b = SimMesh(model, vq_cfg())
    b.load_state_dict(state)
    la = [a.train_step([bt]) for bt in batches[2:]]
    lb = [b.train_step([bt]) for bt in batches[2:]]
    assert la == lb
    assert torch.equal(a.boundaries[1].fwd_vq.receiver_shared, b.boundaries[1].fwd_vq.receiver_shared)


def test_quantised_training_learns_and_the_gradient_is_straight_through():
    """The sender applies the decoded (quantised) gradient to its unquantised Z: training still
    lowers the loss, and the applied gradient is close to the receiver's true one."""
    from thinpipe.boundary.link import receiver_backward, receiver_forward, sender_backward, sender_forward
    from thinpipe.rank.context import make_contexts

    mesh = SimMesh(tiny_model(), vq_cfg(boundary__vq_codes=256))
    losses = [mesh.train_step([tiny_batch(batch_size=2)]) for _ in range(8)]
    assert losses[-1] < losses[0]
    b = mesh.boundaries[0]
    ctx = make_contexts(tiny_batch(batch_size=2), 1, 99, 0)[0]
    x = torch.randn(2, 16, 64, requires_grad=True)
    z, payload = sender_forward(b, x, ctx)
    z_hat, x_hat = receiver_forward(b, payload, ctx, torch.float32)
    g_true = torch.randn_like(x_hat)
    x_hat.backward(g_true)
    true_dz = z_hat.grad.clone()
    sender_backward(b, z, receiver_backward(b, z_hat, ctx), ctx)
    applied = x.grad @ b.projector.A.detach()          # dL/dz applied at the sender, seen through A
    cos = torch.nn.functional.cosine_similarity(applied.flatten(), true_dz.flatten(), dim=0)
    assert cos > 0.9
