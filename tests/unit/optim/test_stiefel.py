"""Polar Express, SPEL on St(d, r), the Grassmann refresh and Muon (MAPL §3.3, App. A, E.3)."""

import pytest
import torch

from thinpipe.optim.muon import Muon
from thinpipe.optim.polar import polar_express
from thinpipe.optim.stiefel import SPEL, grassmann_step, orthonormal, spel_step, stiefel_error, tangent_projection


def svd_polar(G):
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    return U @ Vh


@pytest.mark.parametrize("shape", [(256, 32), (32, 256), (96, 96)])
def test_polar_express_returns_the_polar_factor(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    P = svd_polar(G)
    # 8 iterations in fp32: within 1e-4 relative (square matrices have the widest spectrum);
    # 5 (the LMO setting) is a rough orthogonalisation, as in Muon.
    assert (polar_express(G, 8) - P).norm() / P.norm() < 1e-4
    assert (polar_express(G, 5) - P).norm() / P.norm() < 0.15


def test_seven_step_retraction_of_a_perturbed_frame_is_orthonormal():
    g = torch.Generator().manual_seed(1)
    A = orthonormal(256, 32, g)
    B = polar_express(A - 0.05 * torch.randn(256, 32, generator=g) / 16, 7)
    assert stiefel_error(B) < 1e-4


def test_tangent_projection_defining_property():
    g = torch.Generator().manual_seed(2)
    A = orthonormal(64, 8, g)
    G = torch.randn(64, 8, generator=g)
    T = tangent_projection(A, G)
    S = A.T @ T
    assert torch.allclose(S, -S.T, atol=1e-5)                       # A^T xi skew: xi is tangent at A
    assert torch.allclose(tangent_projection(A, T), T, atol=1e-5)   # a projection
    # the removed part is normal: A sym(A^T G), orthogonal to every tangent vector
    N = G - T
    assert abs(float((N * T).sum())) < 1e-4


def test_spel_stays_on_the_manifold_and_finds_the_principal_subspace():
    """Maximising captured energy ||X A||^2 over St(d, r): SPEL keeps A^T A = I (to 1e-4 after 300
    steps) and converges to the energy of the top-r principal subspace."""
    g = torch.Generator().manual_seed(3)
    d, r = 48, 4
    basis = orthonormal(d, d, g)
    scales = torch.cat([torch.tensor([5.0, 4.0, 3.0, 2.5]), 0.3 * torch.ones(d - 4)])
    X = torch.randn(2000, d, generator=g) * scales @ basis.T
    A = orthonormal(d, r, g)
    m = torch.zeros(d, r)
    best = float(torch.linalg.svdvals(X)[:r].pow(2).sum())
    start = float((X @ A).pow(2).sum())
    for _ in range(300):
        grad = -2 * X.T @ (X @ A) / X.shape[0]
        A = spel_step(A, grad, m, lr=0.05, beta=0.9)
        assert stiefel_error(A) < 1e-4
    final = float((X @ A).pow(2).sum())
    assert start < 0.3 * best and final > 0.99 * best


def test_spel_optimizer_matches_the_function_and_skips_params_without_grad():
    g = torch.Generator().manual_seed(4)
    A0 = orthonormal(32, 4, g)
    grad = torch.randn(32, 4, generator=g)
    p = torch.nn.Parameter(A0.clone())
    idle = torch.nn.Parameter(A0.clone())
    opt = SPEL([p, idle], lr=0.01, beta=0.9)
    p.grad = grad.clone()
    opt.step()
    expect = spel_step(A0, grad, torch.zeros(32, 4), 0.01, 0.9)
    assert torch.allclose(p.detach(), expect, atol=1e-6) and torch.equal(idle.detach(), A0)


def test_grassmann_step_zero_is_identity_and_stays_orthonormal():
    g = torch.Generator().manual_seed(5)
    U = orthonormal(40, 6, g)
    G = torch.randn(40, 6, generator=g)
    assert torch.allclose(grassmann_step(U, G, 0.0), U, atol=1e-6)
    V = grassmann_step(U, G, 0.1)
    assert stiefel_error(V) < 1e-5 and not torch.allclose(V @ V.T, U @ U.T, atol=1e-3)


def test_muon_update_rule_matches_torch_muon():
    """Same orthogonaliser (torch's Newton-Schulz) -> our Muon equals torch.optim.Muon."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(6)
    W = torch.randn(24, 40)
    a, b = torch.nn.Parameter(W.clone()), torch.nn.Parameter(W.clone())
    ours = Muon([a], lr=0.02, momentum=0.95, weight_decay=0.01,
                orthogonalize=lambda u, steps: _zeropower_via_newtonschulz(u, (3.4445, -4.775, 2.0315), steps, 1e-7))
    ref = torch.optim.Muon([b], lr=0.02, momentum=0.95, weight_decay=0.01)
    for _ in range(3):
        G = torch.randn(24, 40)
        a.grad, b.grad = G.clone(), G.clone()
        ours.step()
        ref.step()
    assert torch.allclose(a, b, atol=1e-6)


def test_muon_with_polar_express_makes_a_near_orthogonal_first_update():
    W = torch.nn.Parameter(torch.zeros(16, 64))
    opt = Muon([W], lr=1.0, momentum=0.0, nesterov=False)
    W.grad = torch.randn(16, 64)
    opt.step()
    s = torch.linalg.svdvals(-W.detach())
    assert s.max() < 1.2 and s.min() > 0.8
