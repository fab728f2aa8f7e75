"""Spectral-correction optimizer (paper §3.2, App. E Lemma 2) and anchor-prior delivery."""

import copy

import pytest
import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.optim.spectral import (
    SpectralCorrection,
    anchor_basis,
    blend,
    filter_weights,
    randomized_svd,
    spectral_filter,
)


def test_hand_computed_3x2_filter_and_blend():
    # M = [[2,0],[0,1],[0,0]] -> U = first two unit vectors, S = (2, 1), V = I; tau = 1 -> d = (2/3, 1/2)
    M = torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    G = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    basis = anchor_basis(M, rank=2, generator=torch.Generator())
    d = filter_weights(basis.S, tau=1.0)
    torch.testing.assert_close(d, torch.tensor([2 / 3, 1 / 2], dtype=torch.float64))
    G_filt = spectral_filter(G, basis, d)
    # X = U^T G V = [[1,2],[3,4]]; diag(d) X diag(d) = [[4/9, 2/3], [1, 1]]; third row is outside span(U)
    want = torch.tensor([[4 / 9, 2 / 3], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(G_filt, want)
    torch.testing.assert_close(blend(G, G_filt, 0.3), 0.3 * G + 0.7 * want)
    # the same through the optimizer wrapper (beta = 0: the momentum is the prior itself)
    p = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    opt = SpectralCorrection([("layers.0.mlp.w", p)], torch.optim.SGD([p], lr=1.0), tau=1.0, alpha=0.3, beta=0.0)
    opt.receive_prior({"layers.0.mlp.w": M})
    p.grad = G.clone()
    opt.step()
    torch.testing.assert_close(p.detach(), -(0.3 * G + 0.7 * want))


def test_relative_tau_is_scale_free():
    S = torch.tensor([4.0, 2.0, 1.0])
    torch.testing.assert_close(filter_weights(S, 0.5, relative=True), filter_weights(10 * S, 0.5, relative=True))
    torch.testing.assert_close(filter_weights(S, 0.5, relative=True), S / (S + 2.0))


def _low_rank_basis(m, n, r, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64)).Q
    return U, torch.tensor(s, dtype=torch.float64), V


def test_signal_in_anchor_subspace_passes_noise_contracted_as_lemma2():
    m, n = 40, 30
    U, S, V = _low_rank_basis(m, n, 3, [1.0, 0.5, 0.1])
    M = U @ torch.diag(S) @ V.T
    basis = anchor_basis(M, rank=64, generator=torch.Generator())
    # (1) tau << s: d ~ 1, a gradient inside span(U) x span(V) passes nearly unchanged
    d = filter_weights(basis.S, 1e-6)
    g = torch.Generator().manual_seed(1)
    signal = U @ torch.randn(3, 3, generator=g, dtype=torch.float64) @ V.T
    out = spectral_filter(signal, basis, d)
    assert (out - signal).norm() / signal.norm() < 1e-4
    # (2) isotropic noise: E||P eps||^2 / E||eps||^2 = r_eff^U r_eff^V / (m n), r_eff = sum d_i^2
    tau = 0.1
    d = filter_weights(basis.S, tau)
    r_eff = float((d ** 2).sum())
    ratios = []
    for _ in range(3000):
        eps = torch.randn(m, n, generator=g, dtype=torch.float64)
        ratios.append(float(spectral_filter(eps, basis, d).norm() ** 2) / (m * n))
    measured = sum(ratios) / len(ratios)
    predicted = r_eff * r_eff / (m * n)
    assert measured == pytest.approx(predicted, rel=0.05)
    assert predicted < 0.01  # the filter removes >99% of isotropic noise energy here


def test_randomized_svd_matches_full_on_low_rank():
    U, S, V = _low_rank_basis(200, 120, 5, [5.0, 4.0, 3.0, 2.0, 1.0])
    M = (U @ torch.diag(S) @ V.T).float()
    b = randomized_svd(M, 5, torch.Generator().manual_seed(0))
    torch.testing.assert_close(b.S, S.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b.U @ torch.diag(b.S) @ b.V.T, M, rtol=1e-4, atol=1e-4)


def _anchor_cfg(**kw):
    base = dict(model__name="tiny-llama", mesh__pp=2, boundary__kind="mask", boundary__p=0.5, train__batch_size=2,
                train__lr=1e-3, mesh__anchor=1, anchor__staleness=3, optim__spectral__rank=8)
    base.update(kw)
    return config(**base)


def _run(mesh, steps, anchor_every=None):
    losses = []
    for step in range(steps):
        losses.append(mesh.train_step([tiny_batch(2, seed=step)], tiny_batch(2, seed=100 + step)))
    return losses


def test_prior_consumed_exactly_delta_steps_later_never_before():
    mesh = SimMesh(tiny_model("llama"), _anchor_cfg(anchor__every=2))
    received = []
    orig = SpectralCorrection.receive_prior

    def spy(self, grads):
        received.append(mesh.step_index)
        return orig(self, grads)

    SpectralCorrection.receive_prior = spy
    try:
        _run(mesh, 9)
    finally:
        SpectralCorrection.receive_prior = orig
    # cycles start at 0, 2, 4, 6, 8 -> due at 3, 5, 7, 9, 11; within 9 steps (0..8): 3, 5, 7; two stages each
    assert received == [3, 3, 5, 5, 7, 7]
    assert mesh.anchor.staleness_seen == [3, 3, 3] and mesh.priors_consumed == 3
    assert [p.due_step for p in mesh.anchor.pending] == [9, 11]


def test_prior_uses_the_weights_of_its_start_step():
    mesh = SimMesh(tiny_model("llama"), _anchor_cfg())
    before = copy.deepcopy([st.state_dict() for st in mesh.replicas[0]])
    mesh.train_step([tiny_batch(2, seed=0)], tiny_batch(2, seed=100))
    for mine, ref in zip(mesh.anchor.stages, before):
        for k, v in mine.state_dict().items():
            assert torch.equal(v, ref[k]), k


def test_alpha_one_is_exactly_the_inner_optimizer():
    """With priors arriving and the filter computed, alpha = 1 leaves AdamW's trajectory bitwise intact."""
    model = tiny_model("llama")
    plain = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2, boundary__kind="mask", boundary__p=0.5,
                                  train__batch_size=2, train__lr=1e-3))
    corrected = SimMesh(model, _anchor_cfg(optim__spectral__alpha=1.0, anchor__staleness=1))
    assert _run(plain, 5) == _run(corrected, 5)
    assert corrected.priors_consumed == 4
    for a, b in zip(plain.replicas[0], corrected.replicas[0]):
        for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(v, w), k


def test_without_prior_the_optimizer_equals_the_inner_one():
    model = tiny_model("llama")
    plain = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2, boundary__kind="mask", boundary__p=0.5,
                                  train__batch_size=2, train__lr=1e-3))
    corrected = SimMesh(model, _anchor_cfg(anchor__staleness=50))  # no prior arrives within the run
    assert _run(plain, 4) == _run(corrected, 4)


def test_correction_changes_the_trajectory_once_priors_arrive():
    model = tiny_model("llama")
    plain = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2, boundary__kind="mask", boundary__p=0.5,
                                  train__batch_size=2, train__lr=1e-3))
    corrected = SimMesh(model, _anchor_cfg(anchor__staleness=1))
    a, b = _run(plain, 4), _run(corrected, 4)
    assert a[:2] == b[:2] and a[2:] != b[2:]  # step 1 consumes the first prior; its effect shows from step 2


def test_checkpoint_round_trip_continues_the_trajectory():
    model = tiny_model("llama")
    cfg = _anchor_cfg(anchor__staleness=2)
    full = SimMesh(model, cfg)
    ref = _run(full, 6)
    first = SimMesh(model, cfg)
    for step in range(3):
        first.train_step([tiny_batch(2, seed=step)], tiny_batch(2, seed=100 + step))
    state = copy.deepcopy(first.state_dict())
    saved = state["ranks"][0][0]["optimizer"]
    assert saved["basis"] and saved["momentum"]
    resumed = SimMesh(model, cfg)
    resumed.load_state_dict(state)
    rest = [resumed.train_step([tiny_batch(2, seed=s)], tiny_batch(2, seed=100 + s)) for s in range(3, 6)]
    assert rest == ref[3:]


def test_diagnostics_restore_the_masked_gradient_and_report_alignment():
    from thinpipe.engine.sim_diagnostics import gradient_diagnostics
    from thinpipe.rank.context import make_contexts

    def ctxs(mesh, batch):
        return make_contexts(batch, mesh.cfg.train.microbatches, mesh.step_index, 0)

    mesh = SimMesh(tiny_model("llama"), _anchor_cfg(anchor__staleness=1, diag__every=1))
    _run(mesh, 2)  # a basis exists from step 1 on
    batch = tiny_batch(2, seed=7)
    mesh.forward_backward([batch])
    before = [{n: p.grad.clone() for n, p in st.named_parameters()} for st in mesh.replicas[0]]
    d = gradient_diagnostics(mesh, ctxs(mesh, batch))
    for st, ref in zip(mesh.replicas[0], before):
        for n, p in st.named_parameters():
            assert torch.equal(p.grad, ref[n])
    assert -1 <= d["cos_mask_clean"] <= 1 and -1 <= d["cos_blend_clean"] <= 1 and d["filt_norm_ratio"] >= 0
    # with identity boundaries the "masked" gradient is the clean one
    dense = SimMesh(tiny_model("llama"), config(model__name="tiny-llama", mesh__pp=2, train__batch_size=2))
    dense.forward_backward([batch])
    assert gradient_diagnostics(dense, ctxs(dense, batch))["cos_mask_clean_all"] == pytest.approx(1.0, abs=1e-9)


def test_anchor_bytes_pull_pass_push():
    mesh = SimMesh(tiny_model("llama"), _anchor_cfg(mesh__dp=2, anchor__staleness=5))
    mesh.train_step([tiny_batch(2, seed=0), tiny_batch(2, seed=1)], tiny_batch(2, seed=2))
    n_params = sum(p.numel() for st in mesh.anchor.stages for p in st.parameters())
    tokens = 2 * 16
    pull, push = n_params * 4, 2 * n_params * 4          # push goes to both fast replicas
    pp = 2 * tokens * 64 * 4                             # one dense boundary, forward + backward
    assert mesh.meter.totals["anchor"] == pull + pp + push
    assert mesh.meter.totals["pp_fwd"] == 2 * tokens * round(0.5 * 64) * 4  # only the fast replicas' masked traffic


def test_compressed_anchor_push_bytes_and_low_rank_prior():
    from thinpipe.dp.powersgd import should_compress

    mesh = SimMesh(tiny_model("llama"), _anchor_cfg(anchor__staleness=5, anchor__push_rank=2))
    mesh.train_step([tiny_batch(2, seed=0)], tiny_batch(2, seed=2))
    prior = mesh.anchor.pending[0]
    n_params = sum(p.numel() for st in mesh.anchor.stages for p in st.parameters())
    push = 0
    for st, grads in zip(mesh.anchor.stages, prior.grads):
        for name, p in st.named_parameters():
            n, m = p.shape[0], p[0].numel() if p.ndim > 1 else 1
            if p.ndim >= 2 and should_compress(n, m, 2, 2.0):
                push += 2 * (n + m)
                assert torch.linalg.matrix_rank(grads[name]) <= 2  # the prior the fast circuit gets is P Q^T
            else:
                push += p.numel()
    tokens = 2 * 16
    assert mesh.meter.totals["anchor"] == (n_params + push) * 4 + 2 * tokens * 64 * 4
    assert push < n_params / 4
