"""PRF activation masking (paper §3.1, App. F)."""

import subprocess
import sys
from types import SimpleNamespace

import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.boundary import MaskBoundary, kept_dims
from thinpipe.boundary.link import receiver_backward, receiver_forward, sender_backward, sender_forward
from thinpipe.boundary.prf import keep_indices, prf_key
from thinpipe.engine.sim_mesh import SimMesh

H = 64


def ctx(step=0, microbatch=0, replica=0):
    return SimpleNamespace(step=step, microbatch=microbatch, replica=replica)


def test_kept_dims_formula():
    assert kept_dims(576, 0.95) == 29 and kept_dims(576, 0.90) == 58 and kept_dims(64, 0.0) == 64


def test_exactly_k_values_each_way_and_zero_grad_outside():
    b = MaskBoundary(0, H, p=0.9, seed=3)
    x = torch.randn(2, 5, H, requires_grad=True)
    z, payload = sender_forward(b, x, ctx())
    assert payload.tensors["values"].shape == (2, 5, b.keep)
    z_hat, x_hat = receiver_forward(b, payload, ctx(), torch.float32)
    assert ((x_hat != 0).sum(-1) == b.keep).all()  # exactly K nonzero dims per token
    upstream = torch.randn(2, 5, H)
    x_hat.backward(upstream)
    gpay = receiver_backward(b, z_hat, ctx())
    assert gpay.tensors["values"].shape == (2, 5, b.keep)
    sender_backward(b, z, gpay, ctx())
    idx = b.indices(ctx(), 10, "cpu").view(2, 5, b.keep)
    kept = torch.zeros(2, 5, H, dtype=torch.bool).scatter(-1, idx, True)
    assert (x.grad[~kept] == 0).all()
    torch.testing.assert_close(x.grad[kept], (upstream * b.scale)[kept])  # chain rule of scatter * scale


def test_indices_differ_across_step_microbatch_boundary_replica():
    base = MaskBoundary(0, H, 0.9, seed=1).indices(ctx(), 8, "cpu")
    assert not torch.equal(base, MaskBoundary(0, H, 0.9, seed=1).indices(ctx(step=1), 8, "cpu"))
    assert not torch.equal(base, MaskBoundary(0, H, 0.9, seed=1).indices(ctx(microbatch=1), 8, "cpu"))
    assert not torch.equal(base, MaskBoundary(1, H, 0.9, seed=1).indices(ctx(), 8, "cpu"))
    assert not torch.equal(base, MaskBoundary(0, H, 0.9, seed=1).indices(ctx(replica=1), 8, "cpu"))
    assert not torch.equal(base, MaskBoundary(0, H, 0.9, seed=2).indices(ctx(), 8, "cpu"))
    assert torch.equal(base, MaskBoundary(0, H, 0.9, seed=1).indices(ctx(), 8, "cpu"))
    # rows are distinct sorted index sets in range
    assert (base[:, 1:] > base[:, :-1]).all() and base.min() >= 0 and base.max() < H
    assert len({tuple(r.tolist()) for r in base}) == 8


def test_indices_identical_in_another_process():
    """Sender and receiver are different processes in a real mesh: the PRF is a pure function."""
    key = prf_key(7, 2, 1234, 5, 1)
    mine = keep_indices(key, 32, 576, 29)
    code = ("import torch,sys; from thinpipe.boundary.prf import keep_indices, prf_key;"
            "k=prf_key(7,2,1234,5,1); "
            "sys.stdout.write(','.join(map(str,keep_indices(k,32,576,29).flatten().tolist())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert torch.equal(mine.flatten(), torch.tensor([int(v) for v in out.split(",")]))
    assert mine[0, :5].tolist() == keep_indices(key, 1, 576, 29)[0, :5].tolist()


def test_rescaled_mask_is_unbiased_over_draws():
    b = MaskBoundary(0, H, p=0.9, seed=0)
    x = torch.randn(1, 4, H)
    acc = torch.zeros_like(x)
    n = 4000
    for step in range(n):
        z, payload = sender_forward(b, x, ctx(step=step))
        acc += receiver_forward(b, payload, ctx(step=step), torch.float32)[1].detach()
    mean = acc / n
    # per-coordinate std of the estimator is |x| sqrt((H/K - 1)/n); allow 5 sigma
    tol = 5 * x.abs() * ((b.scale - 1) / n) ** 0.5 + 1e-6
    assert ((mean - x).abs() <= tol).all()
    # without rescale the mean shrinks to K/H of x
    nb = MaskBoundary(0, H, p=0.9, seed=0, rescale=False)
    z, payload = sender_forward(nb, x, ctx())
    assert receiver_forward(nb, payload, ctx(), torch.float32)[1].abs().max() <= x.abs().max()


def test_metered_bytes_equal_formula():
    model = tiny_model("llama")
    cfg = config(model__name="tiny-llama", mesh__pp=4, boundary__kind="mask", boundary__p=0.9,
                 train__batch_size=3, train__microbatches=3, train__seq_len=16)
    mesh = SimMesh(model, cfg)
    mesh.forward_backward([tiny_batch(batch_size=3, seq_len=16)])
    k = kept_dims(64, 0.9)
    tokens = 3 * 16
    expected = 3 * tokens * k * 4  # 3 boundaries x tokens x K x fp32
    assert mesh.meter.totals["pp_fwd"] == expected
    assert mesh.meter.totals["pp_bwd"] == expected
    assert all(b.expected_bytes(tokens, 4) == (tokens * k * 4,) * 2 for b in mesh.boundaries)


def test_masked_boundary_subset_and_bf16_wire():
    model = tiny_model("llama")
    cfg = config(model__name="tiny-llama", mesh__pp=4, boundary__kind="mask", boundary__p=0.5,
                 boundary__masked=[1], train__batch_size=2, train__seq_len=16, train__dtype="bfloat16")
    mesh = SimMesh(model, cfg)
    mesh.forward_backward([tiny_batch(batch_size=2, seq_len=16)])
    tokens = 2 * 16
    expected = (tokens * 64 + tokens * 32 + tokens * 64) * 2  # dense, masked, dense; 2-byte bf16 wire
    assert mesh.meter.totals["pp_fwd"] == expected == mesh.meter.totals["pp_bwd"]
    assert [b.kind for b in mesh.boundaries] == ["identity", "mask", "identity"]


def test_topk_keeps_largest_sends_indices_and_matches_backward_sparsity():
    from thinpipe.boundary import TopKBoundary

    b = TopKBoundary(0, H, p=0.9)
    x = torch.randn(2, 3, H, requires_grad=True)
    z, payload = sender_forward(b, x, ctx())
    assert payload.tensors["indices"].dtype == torch.int16 and payload.tensors["values"].shape == (2, 3, b.keep)
    z_hat, x_hat = receiver_forward(b, payload, ctx(), torch.float32)
    kept = x_hat != 0
    assert (kept.sum(-1) == b.keep).all()
    # the kept entries are the K largest magnitudes of each token, unscaled
    thresh = x.detach().abs().topk(b.keep, -1).values[..., -1:]
    assert torch.equal(kept, x.detach().abs() >= thresh)
    assert torch.equal(x_hat[kept], x.detach()[kept])
    x_hat.backward(torch.ones_like(x_hat))
    gpay = receiver_backward(b, z_hat, ctx())
    assert set(gpay.tensors) == {"values"}  # no indices on the way back
    sender_backward(b, z, gpay, ctx())
    assert torch.equal(x.grad != 0, kept)
    fwd, bwd = b.expected_bytes(6, 4)
    assert payload.nbytes == fwd == 6 * b.keep * (4 + 2) and gpay.nbytes == bwd == 6 * b.keep * 4


def test_p_warmup_ramps_kept_dims_and_stays_unbiased():
    b = MaskBoundary(0, H, p=0.9, seed=0, warmup_steps=10)
    assert [b.keep_at(s) for s in (0, 5, 10, 50)] == [64, kept_dims(64, 0.45), b.keep, b.keep]
    x = torch.randn(1, 2, H)
    z, payload = sender_forward(b, x, ctx(step=5))
    assert payload.tensors["values"].shape[-1] == kept_dims(64, 0.45)
    x_hat = receiver_forward(b, payload, ctx(step=5), torch.float32)[1]
    kept = x_hat != 0
    torch.testing.assert_close(x_hat[kept], x[kept] * 64 / kept_dims(64, 0.45))
    z, payload = sender_forward(b, x, ctx(step=0))
    assert torch.equal(receiver_forward(b, payload, ctx(step=0), torch.float32)[1], x)  # p = 0: dense, exact
