"""Issue 36's ``klt`` kind (boundary/klt.py): the allocation is reverse water-filling on Lloyd-Max's
distortion curve (a hand-computed case), the KLT codes beat a Hadamard rotation at the same bits on
correlated data and land on their predicted distortion, loss tokens get their bits, bytes equal the
formula and the meter on both wires (the start's payload included), a malformed payload is refused,
and a saved boundary loads into a fresh one."""

import json
import math

import pytest
import torch

from tests.helpers import config, crash_sim_at_step, tiny_batch, tiny_model
from thinpipe.boundary import KltBoundary, OutlierBoundary
from thinpipe.boundary.lloyd_max import gaussian_distortion
from thinpipe.boundary.transform_code import allocate_bits, loss_tokens, widths
from thinpipe.comm.header import PayloadError, spec_of
from thinpipe.comm.payload import Payload
from thinpipe.config import ConfigError
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.rank.context import make_contexts

H = 64


def test_bits_go_where_each_bit_removes_the_most_distortion():
    # By hand, with D(1..5) = 0.3634, 0.1175, 0.0345, 0.0095, 0.0025 and variances 16, 1, 1/16: the first
    # three bits go to the 16 (drops 10.2, 3.9, 1.3 beat the 1's 0.64), the fourth to the 1 (0.64 > 16 x
    # 0.025 = 0.40), the fifth back to the 16 (0.40 > 0.25), the sixth to the 1 (0.25 > 16 x 0.007 = 0.11).
    lam = torch.tensor([16.0, 1.0, 1 / 16])
    assert allocate_bits(lam, 1.0).tolist() == [3, 0, 0]
    assert allocate_bits(lam, 2.0).tolist() == [4, 2, 0]
    assert allocate_bits(torch.ones(8), 1.5).tolist() == [2, 2, 2, 2, 1, 1, 1, 1]  # ties: lower index first
    assert allocate_bits(lam, 8.0).tolist() == [8, 8, 8]  # at most 8 bits a component
    assert [round(gaussian_distortion(b), 4) for b in (1, 2, 3, 4)] == [0.3634, 0.1175, 0.0345, 0.0095]


def correlated(n: int, seed: int = 0) -> torch.Tensor:
    """(n, H) Gaussian activations with a steep spectrum in a random basis, and a mean."""
    q, _ = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(123)))  # one basis
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.logspace(1, -2, H)
    return 3.0 + (torch.randn(n, H, generator=g) * spectrum.sqrt()) @ q.T


def ctx_of(labels: torch.Tensor):
    return make_contexts({"input_ids": torch.zeros_like(labels), "labels": labels,
                          "segment_ids": torch.zeros_like(labels)}, 1, 0, 0)[0]


def fitted(loss_bits=2.0, context_bits=2.0, **kw) -> KltBoundary:
    b = KltBoundary(0, H, loss_bits, context_bits, 1, 16, **{"channels": 0, **kw})
    b.load_init(b.init_from_residuals(correlated(8192, seed=1)))
    return b


def test_klt_codes_beat_a_rotation_at_the_same_bits_and_land_on_their_predicted_distortion():
    x = correlated(4096).reshape(64, 64, H)
    labels = torch.zeros(64, 64, dtype=torch.long)  # every token scored but each row's last
    b = fitted()
    ctx = ctx_of(labels)
    _, payload = b.encode(x, ctx)
    err = (b.decode(payload, ctx) - x).pow(2).sum() / (x - x.mean((0, 1))).pow(2).sum()
    rot = OutlierBoundary(0, H, 0, 2, 1, H, grid="lloyd-max", scale_group=-1)
    _, p = rot.encode(x - 3.0, ctx)
    err_rot = (rot.decode(p, ctx) - (x - 3.0)).pow(2).sum() / (x - x.mean((0, 1))).pow(2).sum()
    lam = b.std.float().pow(2)
    predicted = float((lam * torch.tensor([gaussian_distortion(k) if k else 1.0 for k in b.bits_loss.tolist()])).sum()
                      / torch.logspace(1, -2, H).sum())
    assert float(err) < 0.25 * float(err_rot)  # a steep spectrum: far more than a rotation's 2 bits buy
    # the prediction knows each component's variance; the codec estimates one scale per token from the
    # token itself (for real activations, whose norms vary by token), which costs ~30% on stationary data
    assert predicted < float(err) < 1.4 * predicted


def test_a_scale_per_width_keeps_the_heavy_tokens_that_one_scale_per_token_clips():
    """A few tokens far larger than the rest along the top components (SmolLM2's early template tokens): with
    one scale per token their top coefficients clip and their small ones round to 0; one per width fixes both."""
    x = correlated(2048).reshape(32, 64, H)
    x[:, 5] = 3.0 + 40 * (x[:, 5] - 3.0) * (torch.arange(H) < 8)  # position 5: huge along a few directions
    labels = torch.ones(32, 64, dtype=torch.long)
    ctx = ctx_of(labels)
    errs = {}
    for scale in ("token", "width"):
        b = KltBoundary(0, H, 3.0, 1.0, 1, 16, channels=0, scale=scale)
        b.load_init(b.init_from_residuals(x.reshape(-1, H)))
        x_hat = b.decode(b.encode(x, ctx)[1], ctx)
        errs[scale] = float((x_hat - x).pow(2).sum() / (x - x.mean((0, 1))).pow(2).sum())
    assert errs["width"] < 0.4 * errs["token"]


def test_loss_tokens_get_their_bits_and_the_others_theirs():
    b = fitted(loss_bits=4.0, context_bits=1.0)
    x = correlated(2 * 64).reshape(2, 64, H)
    labels = torch.full((2, 64), -100)
    labels[:, 33:] = 1  # positions 32..62 are scored
    ctx = ctx_of(labels)
    scored = loss_tokens(labels)
    assert scored[:, 32:63].all() and not scored[:, :32].any() and not scored[:, 63].any()
    _, payload = b.encode(x, ctx)
    err = (b.decode(payload, ctx) - x).pow(2).sum(-1)
    assert err[scored].mean() < 0.1 * err[~scored].mean()
    assert payload.tensors["loss_scale"].shape == (62, len(widths(b.bits_loss)))
    assert payload.tensors["context_scale"].shape == (66, len(widths(b.bits_context)))


def test_the_receiver_expects_exactly_what_the_sender_sends_and_refuses_anything_else():
    b = fitted(loss_bits=3.0, context_bits=1.0, bwd_tokens=0.5)
    labels = torch.full((2, 16), -100)
    labels[0, 5:] = 1
    ctx = ctx_of(labels)
    _, payload = b.encode(correlated(32).reshape(2, 16, H), ctx)
    expect = b.payload_expect("fwd", 32, ctx)
    expect.check(spec_of(payload), "test")
    assert payload.nbytes == expect.max_bytes == b.expected_bytes(32, 4, loss_tokens=11)[0]
    assert b.payload_expect("fwd", 32).max_bytes >= payload.nbytes  # without the context: a true bound
    other = ctx_of(torch.full((2, 16), -100))  # the receiver's labels say no token is scored
    with pytest.raises(PayloadError, match="refused before allocating"):
        b.payload_expect("fwd", 32, other).check(spec_of(payload), "test")
    with pytest.raises(PayloadError, match="does not match"):
        b.decode(payload, other)
    bad = dict(payload.tensors)
    bad["basis"] = bad.pop("loss_scale")
    with pytest.raises(PayloadError, match="does not fit"):
        b.load_init(Payload(bad))


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_the_meter_counts_the_formula_and_the_start(wire):
    """Meter == expected_bytes == the module docstring's hand count; the start's payload is metered once
    per copy it reaches (both ends of each of 2 replicas but the owner's: 3) on ``pp_params``."""
    cfg = config(model__name="tiny-llama", mesh__pp=2, mesh__dp=2, boundary__kind="klt", boundary__quant_group=16,
                 boundary__klt_bits=3.0, boundary__klt_context_bits=1.0, boundary__dtype=wire,
                 train__batch_size=2, train__seq_len=16)
    mesh = SimMesh(tiny_model("llama"), cfg)
    mesh.residual_start([tiny_batch(batch_size=2, seq_len=16, seed=s) for s in range(4)])
    b = mesh.boundaries[0]
    m = b.basis.shape[1]
    start = 4 * 8 + H * 2 + H * m * 2 + m * 2 + 2 * m  # channels (int64), mean, basis, sqrt(lambda), tables
    assert mesh.meter.totals["pp_params"] == 3 * start
    batches = [tiny_batch(batch_size=2, seq_len=16, seed=10 + r) for r in range(2)]
    mesh.forward_backward(batches)
    size = 4 if wire == "float32" else 2
    fwd = bwd = 0
    for batch in batches:
        for c in make_contexts(batch, cfg.train.microbatches, 0, 0):
            n, loss = c.tokens, int(loss_tokens(c.labels).sum())
            # intact channels, one bf16 scale per token and width, the codes of each width packed alone
            hand = n * 4 * 2 + sum(count * 2 * len(widths(bits)) + sum(math.ceil(count * int((bits == k).sum()) * k / 8)
                                                                       for k in range(1, 9))
                                   for count, bits in ((loss, b.bits_loss), (n - loss, b.bits_context)))
            kept = math.ceil(0.5 * n)
            assert b.expected_bytes(n, size, loss_tokens=loss) == (hand, kept * (H // 8 + 2) + math.ceil(n / 8))
            fwd, bwd = fwd + hand, bwd + kept * (H // 8 + 2) + math.ceil(n / 8)
    assert (mesh.meter.totals["pp_fwd"], mesh.meter.totals["pp_bwd"]) == (fwd, bwd)


def test_a_saved_boundary_loads_into_a_fresh_one_and_codes_the_same():
    b = fitted(loss_bits=3.0, context_bits=1.0, channels=4)
    fresh = KltBoundary(0, H, 3.0, 1.0, 1, 16, channels=4)
    fresh.load_state_dict(b.state_dict())
    labels = torch.full((1, 32), 1)
    ctx = ctx_of(labels)
    x = correlated(32).reshape(1, 32, H)
    assert torch.equal(fresh.decode(b.encode(x, ctx)[1], ctx), b.decode(b.encode(x, ctx)[1], ctx))


@pytest.mark.parametrize("sets, message", [
    ({"boundary__klt_bits": 9.0}, "klt.bits and boundary.klt.context_bits must be in"),
    ({"boundary__klt_bwd_tokens": 0.0}, "klt.bwd_tokens in"),
    ({"boundary__quant_group": 24}, "power of two for klt"),
])
def test_bad_settings_are_one_line_errors(sets, message):
    with pytest.raises(ConfigError, match=message):
        config(**{"boundary__kind": "klt", **sets})


def test_both_ends_refit_the_same_bases_from_what_they_hold_and_the_gradient_gets_its_own():
    """A refresh is computed by each end from decoded data it holds: two copies (a real sender and
    receiver) end bitwise equal to the simulation's one object holding both ends; the gradient's basis,
    fitted from the decoded gradients, codes a correlated gradient better than the Hadamard tiles did."""
    def fresh():
        b = KltBoundary(0, H, 3.0, 1.0, 1, 16, channels=4, refresh_every=2, bwd_tokens=0.5)
        b.load_init(b.init_from_residuals(correlated(4096, seed=1)))
        return b

    one, sender, receiver = fresh(), fresh(), fresh()
    labels = torch.full((2, 32), 1)
    labels[:, :8] = -100
    grads, errors = [], []
    for step in range(3):
        for mb in range(2):
            ctx = ctx_of(labels)
            ctx.step, ctx.microbatch = step, mb
            x = correlated(64, seed=10 * step + mb).reshape(2, 32, H)
            g = (correlated(64, seed=100 + 10 * step + mb) - 3.0).flip(-1).reshape(2, 32, H)
            for a, b in ((one, one), (sender, receiver)):
                _, p = a.encode(x, ctx)
                b.payload_expect("fwd", 64, ctx).check(spec_of(p), "fwd")  # asked before decoding, as a rank does
                x_hat = b.decode(p, ctx)
                q = b.encode_grad(g, ctx)
                a.payload_expect("bwd", 64, ctx).check(spec_of(q), "bwd")
                g_hat = a.decode_grad(q, ctx)
                fwd_end = a
                if fwd_end is one:
                    grads.append(g_hat)
                    kept = g_hat.reshape(-1, H).abs().sum(1) > 0
                    errors.append(float((g_hat.reshape(-1, H)[kept] - g.reshape(-1, H)[kept]).pow(2).sum()
                                        / g.reshape(-1, H)[kept].pow(2).sum()))
                    assert x_hat.shape == x.shape
    for b in (sender, receiver):
        for name, t in one.state_dict().items():
            assert torch.equal(t, b.state_dict()[name]), name
    assert bool(one.grad_klt) and one.gbasis.shape[1] <= H
    assert max(errors[4:]) < 0.8 * min(errors[:4])  # after the refit at step 2: the gradient's own basis


@pytest.mark.slow
def test_a_refreshing_run_resumes_bitwise_across_its_refresh(tmp_path, monkeypatch):
    """Crash at step 4 of 5, resume from step 3's checkpoint: the moments gathered since the refresh at
    step 2 come back with it, so the refresh at step 4 and the rest of the run are the uninterrupted run's."""
    from thinpipe.checkpoint import latest_complete
    from thinpipe.cli import main

    args = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "train.batch_size=2",
            "--set", "train.seq_len=32", "--set", "train.steps=5", "--set", "mesh.pp=2",
            "--set", "boundary.kind=klt", "--set", "boundary.quant_group=16", "--set", "boundary.klt_channels=4",
            "--set", "boundary.klt_refresh_every=2", "--set", "train.checkpoint_every=3", "--set", "train.lr=1e-3"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", "--out", str(full), "--quiet", *args]) == 0
    undo = crash_sim_at_step(monkeypatch, 4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(["train", "--out", str(part), "--quiet", *args])
    undo()
    assert main(["train", "--out", str(part), "--quiet", "--resume", *args]) == 0
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, part)]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]
    assert [r["pp_bwd_bytes"] for r in rows[0]] == [r["pp_bwd_bytes"] for r in rows[1]]
    a, b = (latest_complete(d / "checkpoint", "mesh")[1]["mesh"]["boundaries"][0][0] for d in (full, part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert bool(a["grad_klt"]) and float(a["fwd_n"]) > 0


def test_an_int8_basis_halves_the_start_and_codes_as_well():
    x = correlated(2048).reshape(32, 64, H)
    ctx = ctx_of(torch.ones(32, 64, dtype=torch.long))
    out = {}
    for dtype in ("bfloat16", "int8"):
        b = KltBoundary(0, H, 3.0, 1.0, 1, 16, channels=0, basis_dtype=dtype)
        start = b.init_from_residuals(correlated(8192, seed=1))
        b.load_init(start)
        x_hat = b.decode(b.encode(x, ctx)[1], ctx)
        out[dtype] = start.nbytes, float((x_hat - x).pow(2).sum() / (x - x.mean((0, 1))).pow(2).sum())
    m = b.basis.shape[1]
    assert out["bfloat16"][0] - out["int8"][0] == H * m - 2 * m  # d x m bytes fewer, one bf16 step per column
    assert out["int8"][1] < 1.05 * out["bfloat16"][1]


def test_the_noise_equivalent_diagnosis_has_the_codecs_error_power_without_its_bias():
    """``klt_noise_equivalent`` (issue 52): the decoded activations differ from x by noise whose power in each KLT
    direction and token class is the codec's own (within sampling error), but which is zero-mean and independent of
    x, where the codes' error is not (Lloyd-Max shrinks: the error correlates with x); fresh each step; the wire
    carries it whole and the receiver expects exactly that."""
    x = correlated(64 * 64).reshape(64, 64, H)
    labels = torch.zeros(64, 64, dtype=torch.long)
    labels[:, :20] = -100  # a prompt: context tokens at their own (fewer) bits
    ctx = ctx_of(labels)
    codec, diag = fitted(3.0, 1.0), fitted(3.0, 1.0, noise_equivalent=True)
    codes_err = (codec.decode(codec.encode(x, ctx)[1], ctx) - x).reshape(-1, H)
    _, payload = diag.encode(x, ctx)
    assert set(payload.tensors) == {"x"} and payload.nbytes == diag.expected_bytes(64 * 64, 4)[0] == 64 * 64 * H * 4
    diag.payload_expect("fwd", 64 * 64, ctx).check(spec_of(payload), "test")
    noise_err = (diag.decode(payload, ctx) - x).reshape(-1, H)
    U, centred = codec.basis.float(), (x.reshape(-1, H) - x.reshape(-1, H).mean(0))
    for rows in codec._classes(ctx).values():
        want, got = (codes_err[rows] @ U).pow(2).mean(0), (noise_err[rows] @ U).pow(2).mean(0)
        assert torch.allclose(got, want, rtol=0.25, atol=1e-4)  # 1,300-2,800 tokens a class
        # the codes' error leans against x (shrinkage); the noise's does not
        lean = lambda e: float((e[rows] * centred[rows]).sum() / e[rows].pow(2).sum())  # noqa: E731
        assert lean(codes_err) < -0.1 and abs(lean(noise_err)) < 0.05
    assert noise_err.mean(0).abs().max() < 0.05 * noise_err.std()
    later = make_contexts({"input_ids": torch.zeros_like(labels), "labels": labels,
                           "segment_ids": torch.zeros_like(labels)}, 1, 1, 0)[0]  # step 1: fresh noise
    assert not torch.equal(diag.decode(diag.encode(x, later)[1], later), diag.decode(payload, ctx))


def test_klt_dither_is_unbiased_exactly_decoded_and_metered_as_coded():
    """``klt-dither`` (issue 52): the dithered forward's error is uniform per component and does not lean against x
    (the fixed-width codes' does); without dither (plain ECSQ) it does; the payload is what the coder wrote (the
    meter's bytes), within the receiver's bound, near the model's estimate on Gaussian data; both ends draw the same
    dither from the context (a fresh one each step); a payload of another split or altered is refused; a saved
    boundary loads into a fresh one and codes the same."""
    from thinpipe.boundary import KltDitherBoundary

    x = correlated(64 * 64).reshape(64, 64, H)
    labels = torch.zeros(64, 64, dtype=torch.long)
    labels[:, :20] = -100
    ctx = ctx_of(labels)
    centred = x.reshape(-1, H) - x.reshape(-1, H).mean(0)
    lean = {}
    for dithered in (True, False):
        b = KltDitherBoundary(0, H, 3.0, 1.0, 1, 16, channels=0, dithered=dithered)
        b.load_init(b.init_from_residuals(correlated(8192, seed=1)))
        _, payload = b.encode(x, ctx)
        err = (b.decode(payload, ctx) - x).reshape(-1, H)
        lean[dithered] = float((err * centred).sum() / err.pow(2).sum())
        assert payload.nbytes <= b.payload_expect("fwd", 64 * 64, ctx).max_bytes
        assert payload.nbytes == pytest.approx(b.expected_bytes(64 * 64, 4, loss_tokens=44 * 64 - 64)[0], rel=0.05)
        if dithered:
            fresh = make_contexts({"input_ids": torch.zeros_like(labels), "labels": labels,
                                   "segment_ids": torch.zeros_like(labels)}, 1, 1, 0)[0]
            assert not torch.equal(b.encode(x, fresh)[1].tensors["loss_codes"], payload.tensors["loss_codes"])
            other = KltDitherBoundary(0, H, 3.0, 1.0, 1, 16, channels=0, dithered=True)
            other.load_state_dict(b.state_dict())
            assert torch.equal(other.decode(payload, ctx), b.decode(payload, ctx))
            bad = dict(payload.tensors)
            bad["loss_codes"] = bad["loss_codes"].clone()
            bad["loss_codes"][8] ^= 1
            with pytest.raises(PayloadError, match="does not decode"):
                b.decode(Payload(bad), ctx)
            with pytest.raises(PayloadError, match="does not match"):
                b.decode(payload, ctx_of(torch.full((64, 64), -100)))
    assert abs(lean[True]) < 0.02 and lean[False] < -0.2


@pytest.mark.slow
def test_a_klt_dither_run_resumes_bitwise_with_its_coded_lengths(tmp_path, monkeypatch):
    """``klt-dither`` through the CLI: a crash at step 3 of 4 and a resume from step 2's checkpoint give the
    uninterrupted run's losses and coded forward bytes (the dither is the PRF's of each step: nothing to carry), with
    the sampled half-token backward (its draw is the PRF's too)."""
    from thinpipe.cli import main

    args = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "train.batch_size=2",
            "--set", "train.seq_len=32", "--set", "train.steps=4", "--set", "mesh.pp=2",
            "--set", "boundary.kind=klt-dither", "--set", "boundary.quant_group=16",
            "--set", "boundary.klt-dither.bwd_select=sample",
            "--set", "train.checkpoint_every=2", "--set", "train.lr=1e-3"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", "--out", str(full), "--quiet", *args]) == 0
    undo = crash_sim_at_step(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(["train", "--out", str(part), "--quiet", *args])
    undo()
    assert main(["train", "--out", str(part), "--quiet", "--resume", *args]) == 0
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, part)]
    assert [(r["loss"], r["pp_fwd_bytes"]) for r in rows[0]] == [(r["loss"], r["pp_fwd_bytes"]) for r in rows[1]]
    steps = [r["pp_fwd_bytes"] for r in rows[0]]
    assert len(set(b - a for a, b in zip([0, *steps], steps))) > 1  # coded lengths: a step's bytes vary with data
