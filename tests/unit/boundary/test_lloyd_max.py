"""Issue 26's codecs: the Lloyd-Max grid (boundary/lloyd_max.py) and the outlier kind's new settings
(``outlier_grid``, ``outlier_bwd_scale_group``, ``outlier_bwd_tokens``, ``compress``): levels equal
Max's table, bytes equal the formula and the meter, the token-sparse backward sends exactly its
tokens, a dense direction is bitwise dense."""

import math
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.boundary import OutlierBoundary, Payload
from thinpipe.boundary.lloyd_max import dequantize_rms, gaussian_levels, quantize_rms
from thinpipe.boundary.quant import dequantize, quantize
from thinpipe.comm.header import PayloadError, spec_of
from thinpipe.config import ConfigError
from thinpipe.engine.sim_mesh import SimMesh

H = 64
# J. Max, "Quantizing for minimum distortion" (IRE Trans. Inf. Theory, 1960), Table I: the positive
# output levels of the minimum-MSE quantiser of a unit Gaussian, and its mean squared error.
MAX_1960 = {1: ([0.7980], 0.3634), 2: ([0.4528, 1.510], 0.1175), 3: ([0.2451, 0.7560, 1.344, 2.152], 0.03454),
            4: ([0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733], 0.009497)}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_levels_are_max_1960s_and_reach_its_distortion(bits):
    levels = gaussian_levels(bits)
    positive, mse = MAX_1960[bits]
    assert levels[len(levels) // 2:] == pytest.approx(positive, abs=1.5e-3)
    assert all(a == pytest.approx(-b) for a, b in zip(levels, reversed(levels)))  # symmetric
    x = torch.randn(4000, H, generator=torch.Generator().manual_seed(bits))
    codes, scale = quantize_rms(x, bits, H)
    assert codes.min() >= 0 and codes.max() < 2 ** bits and scale.dtype == torch.bfloat16
    rel = float((dequantize_rms(codes, scale, bits, x.shape) - x).pow(2).mean() / x.pow(2).mean())
    assert rel == pytest.approx(mse, rel=0.06)


def test_lloyd_max_beats_min_max_at_low_bits_and_zeros_stay_zero():
    x = torch.randn(2000, H, generator=torch.Generator().manual_seed(0))
    for bits, at_least in ((1, 5.0), (2, 1.5)):  # min/max: 2.7 / 0.21 relative MSE on 64-value groups
        c, lo, st = quantize(x, bits, H)
        err_mm = float((dequantize(c, lo, st, x.shape) - x).pow(2).mean())
        c, s = quantize_rms(x, bits, H)
        err_lm = float((dequantize_rms(c, s, bits, x.shape) - x).pow(2).mean())
        assert err_mm > at_least * err_lm, (bits, err_mm, err_lm)
    c, s = quantize_rms(torch.zeros(3, H), 2, H)
    assert torch.equal(dequantize_rms(c, s, 2, (3, H)), torch.zeros(3, H))


def ctx_of(b, t):
    return SimpleNamespace(input_ids=torch.zeros(b, t, dtype=torch.long), step=0, microbatch=0, replica=0)


def test_token_sparse_backward_sends_the_largest_tokens_exactly_once():
    torch.manual_seed(0)
    full = OutlierBoundary(0, H, 2, 2, 1, 16, grid="lloyd-max", bwd_scale_group=-1)
    sparse = OutlierBoundary(0, H, 2, 2, 1, 16, grid="lloyd-max", bwd_scale_group=-1, bwd_tokens=0.25)
    g = torch.randn(2, 8, H) * torch.linspace(0.1, 3, 16).reshape(2, 8, 1)
    ctx = ctx_of(2, 8)
    payload = sparse.encode_grad(g, ctx)
    g_hat = sparse.decode_grad(payload, ctx).reshape(16, H)
    top = g.reshape(16, H).norm(dim=1).topk(4).indices
    kept = g_hat.abs().sum(1) > 0
    assert sorted(kept.nonzero().flatten().tolist()) == sorted(top.tolist())
    # a kept token decodes exactly as the dense-token path decodes it (per-token scales: no coupling)
    assert torch.equal(g_hat[kept], full.decode_grad(full.encode_grad(g, ctx), ctx).reshape(16, H)[kept])
    assert payload.nbytes == sparse.expected_bytes(16, 4)[1] == 4 * (H // 8 + 2) + 2  # codes + scale, 16-bit map
    forged = dict(payload.tensors, tokens=torch.full_like(payload.tensors["tokens"], 255))
    with pytest.raises(PayloadError, match="bitmap names 16 tokens, not 4"):
        sparse.decode_grad(Payload(forged), ctx)


@pytest.mark.parametrize("kw", [{}, {"grid": "lloyd-max", "scale_group": -1, "bwd_scale_group": -1},
                                {"grid": "lloyd-max", "bwd_tokens": 0.3, "intact_dtype": torch.bfloat16},
                                {"bwd_tokens": 0.5, "bwd_scale_group": 32}, {"compress": "fwd"}, {"compress": "bwd"},
                                {"grid": "lloyd-max", "bwd_tokens": 0.3, "bwd_select": "sample"}])
@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_the_receiver_expects_exactly_what_the_sender_sends(kw, wire):
    """payload_expect is the payload's exact spec both ways (a dense direction: its byte bound), and a
    peer's payload with a tensor of the wrong length (one scale for every group) is refused."""
    b = OutlierBoundary(0, H, 4, 2, 1, 16, wire, kw.pop("scale_group", 0), kw.pop("intact_dtype", None), **kw)
    ctx = ctx_of(2, 8)
    fwd, bwd = b.encode(torch.randn(2, 8, H), ctx)[1], b.encode_grad(torch.randn(2, 8, H), ctx)
    for direction, payload in (("fwd", fwd), ("bwd", bwd)):
        expect = b.payload_expect(direction, 16)
        expect.check(spec_of(payload), "test")
        assert expect.max_bytes == payload.nbytes == b.expected_bytes(16, 4 if wire is None else 2)[direction == "bwd"]
        name = next((n for n in ("scale", "offset") if n in payload.tensors), None)
        if name is not None:
            forged = Payload({**payload.tensors, name: payload.tensors[name][:1]})
            with pytest.raises(PayloadError, match="refused before allocating"):
                expect.check(spec_of(forged), "test")


def test_one_direction_compressed_leaves_the_other_bitwise_dense():
    x, g, ctx = torch.randn(2, 8, H), torch.randn(2, 8, H), ctx_of(2, 8)
    fwd_only = OutlierBoundary(0, H, 2, 4, 1, 16, compress="fwd")
    assert torch.equal(fwd_only.decode_grad(fwd_only.encode_grad(g, ctx), ctx), g)
    assert not torch.equal(fwd_only.decode(fwd_only.encode(x, ctx)[1], ctx), x)
    bwd_only = OutlierBoundary(0, H, 2, 4, 1, 16, compress="bwd")
    assert torch.equal(bwd_only.decode(bwd_only.encode(x, ctx)[1], ctx), x)
    assert bwd_only.expected_bytes(16, 4)[0] == 16 * H * 4 and fwd_only.expected_bytes(16, 4)[1] == 16 * H * 4


@pytest.mark.parametrize("sets", [
    {"outlier_grid": "lloyd-max"},
    {"outlier_grid": "lloyd-max", "outlier_scale_group": -1, "outlier_bwd_scale_group": -1,
     "outlier_dtype": "bfloat16"},
    {"outlier_grid": "lloyd-max", "outlier_bwd_scale_group": 32, "outlier_bwd_tokens": 0.5},
    {"outlier_bwd_tokens": 0.3},
    {"outlier_grid": "lloyd-max", "outlier_bwd_tokens": 0.3, "outlier_bwd_select": "sample"},
    {"compress": "fwd"}, {"compress": "bwd", "outlier_grid": "lloyd-max"},
])
@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_the_meter_counts_the_formula(sets, wire):
    """Meter == expected_bytes == the hand count of the module docstring, on an fp32 and a bf16 wire."""
    cfg = config(model__name="tiny-llama", mesh__pp=2, boundary__kind="outlier", boundary__outlier_channels=4,
                 boundary__quant_group=16, boundary__fwd_bits=2, boundary__bwd_bits=1, boundary__dtype=wire,
                 train__batch_size=2, train__seq_len=16, **{f"boundary__{k}": v for k, v in sets.items()})
    mesh = SimMesh(tiny_model("llama"), cfg)
    mesh.forward_backward([tiny_batch(batch_size=2, seq_len=16)])
    b, tokens, size = mesh.boundaries[0], 32, 4 if wire == "float32" else 2
    s = 2 if sets.get("outlier_grid") == "lloyd-max" else 4
    S = {0: 16, -1: H}.get(sets.get("outlier_scale_group", 0))
    Sb = {0: 16, -1: H}.get(sets.get("outlier_bwd_scale_group", 0), sets.get("outlier_bwd_scale_group"))
    intact = 2 if sets.get("outlier_dtype") == "bfloat16" else size
    fwd = tokens * (4 * intact + H * 2 // 8 + H // S * s)
    f = sets.get("outlier_bwd_tokens", 1.0)
    per_mb = [16, 16]  # train.microbatches defaults: the meter adds one payload per microbatch
    kept = [math.ceil(f * n) for n in per_mb]
    bwd = sum(k * (H // 8 + H // Sb * s) + (math.ceil(n / 8) if f < 1 else 0) for k, n in zip(kept, per_mb))
    if sets.get("compress") == "bwd":
        fwd = tokens * H * size
    if sets.get("compress") == "fwd":
        bwd = tokens * H * size
    assert (mesh.meter.totals["pp_fwd"], mesh.meter.totals["pp_bwd"]) == (fwd, bwd)
    per_microbatch = [b.expected_bytes(n, size) for n in per_mb]
    assert (sum(f for f, _ in per_microbatch), sum(g for _, g in per_microbatch)) == (fwd, bwd)


def test_per_boundary_forward_bits_go_where_they_are_given():
    cfg = config(model__name="tiny-llama", mesh__pp=4, boundary__kind="outlier", boundary__outlier_channels=4,
                 boundary__quant_group=16, boundary__outlier_fwd_bits=[2, 4, 3], boundary__bwd_bits=1,
                 train__batch_size=2, train__seq_len=16)
    mesh = SimMesh(tiny_model("llama"), cfg)
    assert [b.fwd_bits for b in mesh.boundaries] == [2, 4, 3]
    mesh.forward_backward([tiny_batch(batch_size=2, seq_len=16)])
    assert mesh.meter.totals["pp_fwd"] == sum(b.expected_bytes(32, 4)[0] for b in mesh.boundaries)
    with pytest.raises(ConfigError, match="needs one entry per boundary: 3 with mesh.pp = 4"):
        config(mesh__pp=4, boundary__kind="outlier", boundary__outlier_fwd_bits=[2, 4])


@pytest.mark.parametrize("sets, message", [
    ({"boundary__outlier_fwd_bits": [2, 9]}, "outlier.fwd_bits holds bits in 1..8"),
    ({"boundary__outlier_grid": "e8"}, "outlier.grid must be minmax or lloyd-max"),
    ({"boundary__outlier_bwd_tokens": 0.0}, "outlier.bwd_tokens must be in"),
    ({"boundary__outlier_bwd_select": "random"}, "bwd_select one of"),
    ({"boundary__outlier_entropy": True}, "set boundary.outlier.grid = lloyd-max"),
    ({"boundary__compress": "up"}, "compress must be both, fwd or bwd"),
    ({"boundary__kind": "mask", "boundary__compress": "fwd"}, "compress = fwd is an outlier setting"),
])
def test_bad_settings_are_one_line_errors(sets, message):
    with pytest.raises(ConfigError, match=message):
        config(**{"boundary__kind": "outlier", **sets})


def _bit_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The reference layout: code i's bit j at bit i * bits + j of the stream, bytes little-endian."""
    stream = [(int(c) >> j) & 1 for c in codes for j in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return torch.tensor([sum(b << k for k, b in enumerate(stream[i:i + 8])) for i in range(0, len(stream), 8)],
                        dtype=torch.uint8)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("count", [1, 7, 64, 333])
def test_packed_codes_follow_one_layout_at_every_width(bits, count):
    from thinpipe.boundary.quant import pack_bits, unpack_bits

    codes = torch.randint(0, 2 ** bits, (count,), generator=torch.Generator().manual_seed(count))
    packed = pack_bits(codes, bits)
    assert torch.equal(packed, _bit_planes(codes, bits))
    assert torch.equal(unpack_bits(packed, bits, count), codes)


def test_entropy_coded_codes_are_lossless_cheaper_and_bounded():
    """``outlier.entropy`` (issue 52 item 4): the same decoded values as the packed codes, bitwise, both ways; the
    payload is what the coder wrote, ~the model's estimate (Gaussian data: 3.77 of 4 bits), within the receiver's
    bound; 1-bit codes stay packed; a cut stream, an altered one or a scale of the wrong length is refused."""
    torch.manual_seed(4)
    kw = {"grid": "lloyd-max", "bwd_scale_group": -1, "intact_dtype": torch.bfloat16}
    plain, coded = (OutlierBoundary(0, H, 4, 4, 2, 16, None, -1, entropy=e, **kw) for e in (False, True))
    x, g, ctx = torch.randn(4, 32, H), torch.randn(4, 32, H), ctx_of(4, 32)
    for enc, dec, t in (("encode", "decode", x), ("encode_grad", "decode_grad", g)):
        p_plain, p_coded = (getattr(b, enc)(t, ctx) for b in (plain, coded))
        p_plain, p_coded = (p[1] if isinstance(p, tuple) else p for p in (p_plain, p_coded))
        assert torch.equal(getattr(plain, dec)(p_plain, ctx), getattr(coded, dec)(p_coded, ctx))
        direction = "fwd" if enc == "encode" else "bwd"
        coded.payload_expect(direction, 128).check(spec_of(p_coded), "test")
        assert p_coded.nbytes < p_plain.nbytes <= coded.max_bytes(128, 4)[direction == "bwd"]
        assert p_coded.nbytes == pytest.approx(coded.expected_bytes(128, 4)[direction == "bwd"], rel=0.01)
        cut = dict(p_coded.tensors, codes=p_coded.tensors["codes"][:-8])
        flipped = p_coded.tensors["codes"].clone()
        flipped[12] ^= 4
        short = dict(p_coded.tensors, scale=p_coded.tensors["scale"][:-1])
        for bad, message in ((cut, "does not decode"), (dict(p_coded.tensors, codes=flipped), "does not decode"),
                             (short, "does not match 128 tokens")):
            with pytest.raises(PayloadError, match=message):
                getattr(coded, dec)(Payload(bad), ctx)
    one_bit = OutlierBoundary(0, H, 4, 4, 1, 16, None, -1, entropy=True, **kw)
    assert one_bit.payload_expect("bwd", 128).spec is not None  # exact: packed


def test_an_entropy_coded_mesh_trains_bitwise_as_the_packed_one_on_fewer_bytes():
    meters, losses = [], []
    for entropy in (False, True):
        cfg = config(model__name="tiny-llama", mesh__pp=2, boundary__kind="outlier", boundary__outlier_channels=4,
                     boundary__quant_group=16, boundary__fwd_bits=3, boundary__bwd_bits=1,
                     boundary__outlier_grid="lloyd-max", boundary__outlier_entropy=entropy,
                     train__batch_size=2, train__seq_len=16)
        mesh = SimMesh(tiny_model("llama"), cfg)
        batch = tiny_batch(batch_size=2, seq_len=16)
        losses.append([mesh.train_step([batch]) for _ in range(3)])  # steps 2-3 see step 1's update
        meters.append((mesh.meter.totals["pp_fwd"], mesh.meter.totals["pp_bwd"]))
    assert losses[0] == losses[1] and losses[0][0] != losses[0][2]
    assert meters[1][0] < meters[0][0] and meters[1][1] == meters[0][1]  # 3-bit codes coded, 1-bit ones packed
