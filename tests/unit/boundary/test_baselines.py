"""Activation-compression baselines (anchor-priors Table 4): quant4 / quant2, AQ-SGD, TAH-Quant,
bottleneck. Round-trip error bounds, bytes == formula, AQ-SGD's buffers, the Hadamard transform."""

import math
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.boundary import (
    AqsgdBoundary,
    BottleneckBoundary,
    OutlierBoundary,
    Payload,
    QuantBoundary,
    TahQuantBoundary,
)
from thinpipe.boundary.link import receiver_backward, receiver_forward, sender_backward, sender_forward
from thinpipe.boundary.quant import dequantize, pack_bits, quantize, unpack_bits
from thinpipe.boundary.tahquant import hadamard
from thinpipe.config import ConfigError
from thinpipe.engine.sim_mesh import SimMesh

H = 64


def ctx(ids):
    return SimpleNamespace(step=0, microbatch=0, replica=0, input_ids=ids)


def roundtrip(b, x, ids):
    """One forward and backward through the boundary; returns (x_hat, fwd payload, grad payload, x.grad)."""
    x = x.clone().requires_grad_(True)
    z, payload = sender_forward(b, x, ctx(ids))
    z_hat, x_hat = receiver_forward(b, payload, ctx(ids), torch.float32)
    upstream = torch.randn_like(x_hat)
    x_hat.backward(upstream)
    gpay = receiver_backward(b, z_hat, ctx(ids))
    sender_backward(b, z, gpay, ctx(ids))
    return x_hat.detach(), payload, gpay, x.grad, upstream


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 7, 8])
def test_bit_packing_round_trips_exactly(bits):
    codes = torch.randint(0, 2 ** bits, (1001,))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == (1001 * bits + 7) // 8
    assert torch.equal(unpack_bits(packed, bits, 1001), codes)


@pytest.mark.parametrize("bits, group", [(2, 64), (4, 64), (4, 16), (8, 0)])
def test_quantiser_error_is_within_half_a_step(bits, group):
    """Round-to-nearest on a grid of 2^b levels spanning each group: |x - x_hat| <= step / 2."""
    x = torch.randn(3, 7, H) * torch.logspace(-6, 2, 3)[:, None, None]  # tiny to large magnitudes
    g = group or H
    codes, lo, step = quantize(x, bits, g)
    x_hat = dequantize(codes, lo, step, x.shape)
    err = (x - x_hat).abs().reshape(-1, g)
    assert (err <= step.float()[:, None] / 2 * (1 + 1e-5) + 1e-30).all()
    # and the step is what b bits over the group's range give, up to bf16 rounding (the offset
    # rounded down widens the range by at most 2^-7 |min|, the step rounds up by at most 2^-7)
    lo_true, hi_true = x.reshape(-1, g).min(1).values, x.reshape(-1, g).max(1).values
    levels = 2 ** bits - 1
    assert (step.float() >= (hi_true - lo_true) / levels).all()
    widest = (hi_true - lo_true + lo_true.abs() * 2 ** -7) / levels * (1 + 2 ** -7)
    assert (step.float() <= widest * (1 + 1e-6)).all()


@pytest.mark.parametrize("kind_bits", [(4, 4), (2, 2), (2, 8)])
def test_quant_boundary_bytes_equal_formula_and_gradient_is_quantised(kind_bits):
    fwd_bits, bwd_bits = kind_bits
    b = QuantBoundary(0, H, fwd_bits, bwd_bits, 16)
    ids = torch.zeros(2, 5, dtype=torch.long)
    x = torch.randn(2, 5, H)
    x_hat, payload, gpay, grad, upstream = roundtrip(b, x, ids)
    fwd, bwd = b.expected_bytes(10, 4)
    tokens_values = 10 * H
    assert payload.nbytes == fwd == tokens_values * fwd_bits // 8 + tokens_values // 16 * 4
    assert gpay.nbytes == bwd == tokens_values * bwd_bits // 8 + tokens_values // 16 * 4
    assert 0 < (x_hat - x).abs().max() <= (x.max() - x.min()) / (2 ** fwd_bits - 1)
    # the sender's gradient is the receiver's, quantised at bwd_bits (straight through the wire)
    assert (grad - upstream).abs().max() <= (upstream.max() - upstream.min()) / (2 ** bwd_bits - 1) / 2 * 1.01


def test_metered_bytes_equal_the_formula_for_every_new_kind():
    model = tiny_model("llama")
    tokens = 2 * 16
    for kind in ("quant4", "quant2", "aqsgd", "tahquant", "bottleneck", "outlier"):
        cfg = config(model__name="tiny-llama", mesh__pp=2, boundary__kind=kind, boundary__p=0.9,
                     train__batch_size=2, train__seq_len=16)
        mesh = SimMesh(model, cfg)
        batch = tiny_batch(batch_size=2, seq_len=16)
        mesh.forward_backward([batch])
        first = dict(mesh.meter.totals)
        mesh.forward_backward([batch])  # the same rows again: AQ-SGD's revisit
        second = {a: mesh.meter.totals[a] - first[a] for a in ("pp_fwd", "pp_bwd")}
        fwd, bwd = mesh.boundaries[0].expected_bytes(tokens, 4)
        assert second == {"pp_fwd": fwd, "pp_bwd": bwd}, kind
        if kind == "aqsgd":  # a first visit sends the rows densely (fp32 wire)
            assert first["pp_fwd"] == tokens * H * 4
        else:
            assert first["pp_fwd"] == fwd


def test_aqsgd_buffers_follow_the_update_rule_and_stay_equal_at_both_ends():
    b = AqsgdBoundary(0, H, 2, 8, 16)
    ids = torch.arange(3 * 4).reshape(3, 4)
    a1 = torch.randn(3, 4, H)
    x_hat, *_ = roundtrip(b, a1, ids)
    assert torch.equal(x_hat, a1)                      # first visit: dense
    assert len(b.sent) == len(b.received) == 3
    a2 = a1 + 0.01 * torch.randn(3, 4, H)              # the activation moved a little
    m_before = torch.stack([b.sent[k] for k in sorted(b.sent)])
    x_hat2, payload, *_ = roundtrip(b, a2, ids)
    assert "dense" not in payload.tensors
    # x_hat = m + deq(Q(a - m)): error within half a step of the *delta's* range, far below a
    # direct 2-bit quantisation of a2
    direct = (a2.max() - a2.min()) / 3 / 2
    assert (x_hat2 - a2).abs().max() < direct / 20
    for k in b.sent:
        assert torch.equal(b.sent[k], b.received[k])
    m_after = torch.stack([b.sent[k] for k in sorted(b.sent)])
    assert not torch.equal(m_before, m_after)
    # rows it has not seen are sent densely, alongside the revisited ones
    ids3 = torch.cat([ids[:1], ids[:1] + 100])
    x_hat3, payload3, *_ = roundtrip(b, torch.cat([a2[:1], a1[:1]]), ids3)
    assert payload3.tensors["dense"].shape[0] == 1 and torch.equal(x_hat3[1], a1[0])
    assert b.memory_bytes() == 2 * 4 * 4 * H * 4  # 4 rows x (T=4, H) fp32, both ends


def test_aqsgd_buffers_are_saved_in_checkpoints(tmp_path):
    model = tiny_model("llama")
    cfg = config(model__name="tiny-llama", mesh__pp=2, boundary__kind="aqsgd", train__batch_size=2,
                 train__seq_len=16)
    mesh = SimMesh(model, cfg)
    batch = tiny_batch(batch_size=2, seq_len=16)
    mesh.forward_backward([batch])
    torch.save(mesh.state_dict(), tmp_path / "ck.pt")
    fresh = SimMesh(tiny_model("llama"), cfg)
    fresh.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=False))
    b0, b1 = mesh.boundaries[0], fresh.boundaries[0]
    assert set(b0.sent) == set(b1.sent) == set(b1.received) and len(b0.sent) == 2
    for k in b0.sent:
        assert torch.equal(b0.sent[k], b1.sent[k]) and torch.equal(b0.received[k], b1.received[k])
    assert mesh.boundary_memory_bytes() == fresh.boundary_memory_bytes() > 0


def test_hadamard_is_orthogonal_and_self_inverse():
    x = torch.randn(5, 64)
    y = hadamard(x)
    assert torch.allclose(hadamard(y), x, atol=1e-5)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), atol=1e-4)
    H8 = hadamard(torch.eye(8))
    assert torch.allclose(H8 @ H8.T, torch.eye(8), atol=1e-6) and \
        torch.allclose(H8.abs(), torch.full((8, 8), 8 ** -0.5))
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(torch.randn(3, 12))


def test_the_hadamard_matmul_gives_the_butterflys_codes():
    """``hadamard`` is one matmul with the butterfly's matrix (issue 36): the values agree to rounding and the
    Lloyd-Max codes of a SmolLM2-sized microbatch (256 x 576 values) agree bitwise at 1, 2 and 4 bits."""
    from thinpipe.boundary.lloyd_max import quantize_rms
    from thinpipe.boundary.tahquant import hadamard_butterfly

    x = torch.randn(256 * 9, 64, generator=torch.Generator().manual_seed(0)) * 3
    a, b = hadamard_butterfly(x), hadamard(x)
    assert torch.allclose(a, b, atol=1e-5, rtol=0)
    for bits in (1, 2, 4):
        codes = [quantize_rms(t.reshape(-1, 576), bits, 576)[0] for t in (a, b)]
        assert torch.equal(*codes)


def test_tahquant_rotates_outlier_tiles_and_beats_plain_quantisation_on_them():
    torch.manual_seed(0)
    x = torch.randn(4, 8, H)
    x[..., 5] *= 40            # an outlier channel, as LLM residual streams have
    ids = torch.zeros(4, 8, dtype=torch.long)
    tah = TahQuantBoundary(0, H, 2, 8, 64, 0.25, 4.0)
    plain = QuantBoundary(0, H, 2, 8, 64)
    xt, pay, gpay, *_ = roundtrip(tah, x, ids)
    xp, *_ = roundtrip(plain, x, ids)
    meta = pay.tensors["meta"]
    assert ((meta & 127) > 0).float().mean() > 0.9          # the outlier tiles were rotated
    assert int(((meta & 128) > 0).sum()) == round(0.25 * 32)  # a quarter got one more bit
    # error on the non-outlier channels: the rotation spreads the outlier instead of letting it
    # set every tile's step
    rest = [c for c in range(H) if c != 5]
    assert (xt - x)[..., rest].pow(2).mean() < (xp - x)[..., rest].pow(2).mean()
    fwd, bwd = tah.expected_bytes(32, 4)
    assert pay.nbytes == fwd and gpay.nbytes == bwd


def test_bottleneck_is_a_projection_at_start_and_its_halves_live_on_their_stages():
    b = BottleneckBoundary(0, H, 0.9, seed=0)
    assert b.keep == 6
    A = b.up.weight
    assert torch.allclose(A.T @ A, torch.eye(6), atol=1e-5)
    ids = torch.zeros(2, 3, dtype=torch.long)
    x = torch.randn(2, 3, H)
    x_hat, pay, gpay, grad, _ = roundtrip(b, x, ids)
    assert torch.allclose(x_hat, x @ A @ A.T, atol=1e-5)
    assert pay.nbytes == gpay.nbytes == 6 * 6 * 4 == b.expected_bytes(6, 4)[0]
    assert b.down.weight.grad is not None and b.up.weight.grad is not None
    model = tiny_model("llama")
    mesh = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2, boundary__kind="bottleneck",
                                 train__batch_size=2, train__seq_len=16))
    stages = mesh.replicas[0]
    assert "out_down" in stages[0].boundary_modules and "in_up" in stages[1].boundary_modules


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["quant4", "quant2", "aqsgd", "tahquant", "bottleneck", "outlier"])
def test_every_new_kind_trains_in_the_engine(kind, tmp_path):
    from thinpipe.engine.sim_engine import train

    cfg = config(model__name="tiny-llama", data__name="synthetic", mesh__pp=2, boundary__kind=kind,
                 train__steps=3, train__batch_size=2, train__seq_len=32, data__val_rows=4, eval__every=0,
                 train__checkpoint_every=0)
    summary = train(cfg, tmp_path)
    assert math.isfinite(summary["final_val_loss"]), summary["final_val_loss"]
    assert summary["bytes_per_token"]["pp_fwd"] > 0


@pytest.mark.parametrize("sets, message", [
    ({"boundary__kind": "quant4", "boundary__fwd_bits": 9}, "fwd_bits and boundary.bwd_bits must be in 1..8"),
    ({"boundary__kind": "tahquant", "boundary__quant_group": 48}, "power of two <= 64"),
    ({"boundary__kind": "tahquant", "boundary__fwd_bits": 8}, "<= 7 for tahquant"),
    ({"boundary__kind": "tahquant", "boundary__tah_high_fraction": 2.0}, "tahquant.high_fraction must be in [0, 1]"),
])
def test_bad_baseline_settings_are_refused(sets, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config(**sets)


def test_quant_group_must_divide_the_hidden_size():
    with pytest.raises(ValueError, match="must divide the hidden size"):
        QuantBoundary(0, 64, 4, 4, 48)


def test_outlier_boundary_calibrates_the_massive_channels_and_sends_them_intact():
    """Channels large for every token are found by the residual start, cross exactly, and no longer
    spoil the other channels' grid: far less error than plain 2-bit quantisation at the same bits."""
    torch.manual_seed(0)
    H_, massive = 64, [5, 40]
    x = torch.randn(2, 8, H_)
    x[..., massive] = 60.0 + torch.randn(2, 8, 2)
    b = OutlierBoundary(0, H_, 2, 2, 2, 16)
    assert b.wants_residual_init
    b.load_init(b.init_from_residuals(x.reshape(-1, H_)))
    assert b.channels.tolist() == massive
    ctx = SimpleNamespace(input_ids=torch.zeros(2, 8, dtype=torch.long))
    _, payload = b.encode(x, ctx)
    x_hat = b.decode(payload, ctx)
    assert torch.equal(x_hat[..., massive], x[..., massive])
    fwd, bwd = b.expected_bytes(16, 4)
    assert payload.nbytes == fwd == 16 * 2 * 4 + 16 * H_ * 2 // 8 + 16 * H_ // 16 * 4
    assert b.encode_grad(torch.randn(2, 8, H_), ctx).nbytes == bwd == 16 * H_ * 2 // 8 + 16 * H_ // 16 * 4
    plain = QuantBoundary(0, H_, 2, 2, 16)
    err_plain = (plain.decode(plain.encode(x, ctx)[1], ctx) - x).pow(2).mean()
    err = (x_hat - x).pow(2).mean()
    assert err < err_plain / 10, (float(err), float(err_plain))
    # the backward: a rotated tile's error stays within the tile's rotated range (orthonormal H)
    g = torch.randn(2, 8, H_)
    g_hat = b.decode_grad(b.encode_grad(g, ctx), ctx)
    assert (g_hat - g).pow(2).mean() < g.pow(2).mean() / 2
    with pytest.raises(ValueError, match="do not fit"):
        b.load_init(Payload({"channels": torch.tensor([1, 99])}))


@pytest.mark.parametrize("scale_group, dtype", [(0, "wire"), (0, "bfloat16"), (H, "wire"), (-1, "wire"),
                                                (2 * 16, "bfloat16")])
def test_outlier_forward_scale_groups_and_bf16_channels_meter_their_formula(scale_group, dtype):
    """Per-token (or wider) forward scales and bf16 intact channels: the meter equals expected_bytes,
    which equals the hand count, and the decode is still close (one scale pair over more dims)."""
    model = tiny_model("llama")
    cfg = config(model__name="tiny-llama", mesh__pp=2, boundary__kind="outlier", boundary__outlier_channels=4,
                 boundary__quant_group=16, boundary__outlier_scale_group=scale_group, boundary__outlier_dtype=dtype,
                 boundary__fwd_bits=4, boundary__bwd_bits=1, train__batch_size=2, train__seq_len=16)
    mesh = SimMesh(model, cfg)
    mesh.forward_backward([tiny_batch(batch_size=2, seq_len=16)])
    tokens, S = 32, H if scale_group == -1 else scale_group or 16
    intact = 2 if dtype == "bfloat16" else 4
    fwd = tokens * (4 * intact + H * 4 // 8 + H // S * 4)
    bwd = tokens * (H * 1 // 8 + H // 16 * 4)
    assert mesh.boundaries[0].expected_bytes(tokens, 4) == (fwd, bwd)
    assert (mesh.meter.totals["pp_fwd"], mesh.meter.totals["pp_bwd"]) == (fwd, bwd)


def test_outlier_scale_group_must_tile_the_hidden_size():
    with pytest.raises(ValueError, match="multiple of the tile"):
        OutlierBoundary(0, 64, 2, 2, 2, 16, scale_group=24)
    with pytest.raises(ConfigError, match="outlier.scale_group must be >= -1"):
        config(boundary__kind="outlier", boundary__outlier_scale_group=-2)
    with pytest.raises(ConfigError, match="outlier.dtype wire or bfloat16"):
        config(boundary__kind="outlier", boundary__outlier_dtype="fp8")
