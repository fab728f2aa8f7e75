"""Gradient diagnostics that explain whether anchor priors help (anchor-priors §3.2: do the priors point
the masked gradient back towards the clean one?).

At a diagnostic step, replica 0's masked gradient (already in ``.grad``) is compared with the clean
gradient of the *same* contexts (the same rows and loss: any objective's) at the *same* weights, computed
by one extra pass through dense boundaries; the masked gradient is then put back untouched. A measurement
of the simulation alone (``SimMesh.update`` runs it): it needs every stage's two gradients in one place. Reported:
  cos_mask_clean      cosine(masked, clean) over the spectrally filtered matrices
  cos_blend_clean     cosine(alpha masked + (1-alpha) filtered, clean) over the same matrices
  filt_norm_ratio     ||filtered|| / ||masked|| over the same matrices
  cos_mask_clean_all  cosine(masked, clean) over every parameter
  above_tau_mean/min/max  singular values of the anchor momentum above tau, per matrix
The paper's mechanism needs cos_blend_clean > cos_mask_clean.
"""

from __future__ import annotations

import dataclasses

import torch

from thinpipe.boundary import Boundary
from thinpipe.optim.spectral import blend, filter_weights, is_filtered, spectral_filter
from thinpipe.rank.context import MicrobatchContext
from thinpipe.rank.worker import StageWorker

DIAG_TAG = -1


def _cos(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))
    na = sum(float(x.double().pow(2).sum()) for x in a) ** 0.5
    nb = sum(float(y.double().pow(2).sum()) for y in b) ** 0.5
    return dot / (na * nb) if na and nb else float("nan")


@torch.no_grad()
def _stash(stages):
    return [{n: p.grad.clone() for n, p in st.named_parameters() if p.grad is not None} for st in stages]


@torch.enable_grad()
def clean_gradient(mesh, ctxs: list[MicrobatchContext]) -> list[dict[str, torch.Tensor]]:
    """Replica 0's unmasked gradient on the rows of ``ctxs`` at its current weights; leaves .grad as it was
    (and ``ctxs``' stats: the pass runs on copies)."""
    stages = mesh.replicas[0]
    masked = _stash(stages)
    for st in stages:
        st.zero_grad(set_to_none=True)
    hidden = stages[0].embed_tokens.embedding_dim
    dense = [Boundary(b.index, hidden, b.wire_dtype) for b in mesh.boundaries]
    workers = [StageWorker(st, DIAG_TAG, dense[s - 1] if s else None, dense[s] if s < len(stages) - 1 else None,
                           mesh.mailbox, mesh.compute_dtype) for s, st in enumerate(stages)]
    meter_before = mesh.meter.snapshot()
    for ctx in (dataclasses.replace(c, extras=dict(c.extras), stats={}) for c in ctxs):
        for w in workers:
            w.forward(ctx)
        for w in reversed(workers):
            w.backward(ctx)
    mesh.meter.totals.update(meter_before)  # diagnostic traffic is not part of the method's bytes
    clean = _stash(stages)
    with torch.no_grad():
        for st, g in zip(stages, masked):
            for n, p in st.named_parameters():
                p.grad = g.get(n)
    return clean


def gradient_diagnostics(mesh, ctxs: list[MicrobatchContext]) -> dict:
    clean = clean_gradient(mesh, ctxs)
    stages, opts = mesh.replicas[0], mesh.optimizers[0]
    all_m, all_c, fm, fc, fb, ff = [], [], [], [], [], []
    above: list[int] = []
    for st, opt, cg in zip(stages, opts, clean):
        basis = getattr(opt, "basis", {})
        for n, p in st.named_parameters():
            if p.grad is None or n not in cg:
                continue
            g = p.grad.float()
            all_m.append(g)
            all_c.append(cg[n])
            if is_filtered(n, p):
                fm.append(g)
                fc.append(cg[n])
                if n in basis:
                    b = basis[n]
                    f = spectral_filter(g, b, filter_weights(b.S, opt.tau, opt.relative_tau))
                    ff.append(f)
                    fb.append(blend(g, f, opt.alpha))
                else:
                    ff.append(torch.zeros_like(g))
                    fb.append(g)
        if hasattr(opt, "count_above_tau"):
            above += list(opt.count_above_tau().values())
    out = {"cos_mask_clean_all": _cos(all_m, all_c), "cos_mask_clean": _cos(fm, fc)}
    if any(getattr(o, "basis", None) for o in opts):
        nm = sum(float(x.pow(2).sum()) for x in fm) ** 0.5
        out.update({"cos_blend_clean": _cos(fb, fc), "cos_filt_clean": _cos(ff, fc),
                    "filt_norm_ratio": (sum(float(x.pow(2).sum()) for x in ff) ** 0.5) / nm if nm else float("nan"),
                    "above_tau_mean": sum(above) / len(above), "above_tau_min": min(above),
                    "above_tau_max": max(above)})
    return out
