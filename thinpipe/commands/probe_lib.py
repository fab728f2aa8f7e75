"""``thinpipe probe``: what each boundary kind does to a model before any training (issue 17).

For every arm of a grid (a boundary kind at a ratio), on held-out batches and at the model's own
weights, the simulated mesh (one replica, ``engine/sim_mesh.py``) runs a forward-backward through the
compressed boundaries and measures:

- the forward damage: held-out loss through the compressed boundaries against the dense loss (the
  function the compressed circuit trains on; anchor-priors §5.2's masked forward, App. F);
- the backward's alignment: cosine of the gradient the compressed circuit computes with the clean
  gradient at the same weights, over every parameter, and per stage (stage 0's gradient crosses
  every boundary);
- the forward's own cost to the gradient (``cos_fwd``, issue 52): the cosine with the clean gradient when only the
  forward is compressed and every activation gradient crosses back exact (``exact_backward``); across the
  frontier's arms it tracked the trained gap (gap ~ 0.57 + 13.9 x (1 - cos_fwd) percent) where the loss damage
  did not. Kinds that are part of the model (MAPL, SSN) have no separate backward to make exact: None;
- the exact bytes per token each way, as the mesh's meter counts them (``pp_fwd``, ``pp_bwd``).

Learned kinds are probed at their start: MAPL with its PCA start (``boundary.init = pca``, what one
would use to adapt a pretrained model), SSN's fixed random basis. A start is not what training
reaches, so for them the probe is a lower bound on quality; for the fixed compressors (mask, top-K,
quantisers) it is the function training starts from. ``thinpipe plan --probe probe.json`` uses the
result to keep its advice within a damage bound (``plan/advice.py``).
"""

from __future__ import annotations

import copy
import gc
import json
import math
import sys
import types
from pathlib import Path

import torch
from tqdm import tqdm

from thinpipe.boundary.base import Boundary
from thinpipe.comm.header import Expect
from thinpipe.config import Config, ConfigError, apply_overrides
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.objective.registry import build_data
from thinpipe.rank.from_config import load, place, residual_batches, val_batches

# The outlier kind on the Lloyd-Max grid, one scale per token each way and bf16 intact channels (issue 26).
LM = {"boundary.kind": "outlier", "boundary.outlier_grid": "lloyd-max", "boundary.outlier_scale_group": -1,
      "boundary.outlier_bwd_scale_group": -1, "boundary.outlier_dtype": "bfloat16"}
# (arm, settings): the default grid, two or more ratios per kind where the kind has a ratio.
GRID: list[tuple[str, dict]] = [
    ("dense", {"boundary.kind": "identity"}),
    ("mask p=0.5", {"boundary.kind": "mask", "boundary.p": 0.5}),
    ("mask p=0.9", {"boundary.kind": "mask", "boundary.p": 0.9}),
    ("mask p=0.95", {"boundary.kind": "mask", "boundary.p": 0.95}),
    ("topk p=0.75", {"boundary.kind": "topk", "boundary.p": 0.75}),
    ("topk p=0.9", {"boundary.kind": "topk", "boundary.p": 0.9}),
    ("topk p=0.95", {"boundary.kind": "topk", "boundary.p": 0.95}),
    ("quant4", {"boundary.kind": "quant4"}),
    ("quant2", {"boundary.kind": "quant2"}),
    ("quant 2b/8b", {"boundary.kind": "quant2", "boundary.bwd_bits": 8}),
    ("tahquant 2b/8b", {"boundary.kind": "tahquant"}),
    ("outlier 4b/2b", {"boundary.kind": "outlier", "boundary.fwd_bits": 4, "boundary.bwd_bits": 2}),
    ("outlier 2b/2b", {"boundary.kind": "outlier"}),
    ("outlier 2b/1b", {"boundary.kind": "outlier", "boundary.bwd_bits": 1}),
    ("outlier 1b/1b", {"boundary.kind": "outlier", "boundary.fwd_bits": 1, "boundary.bwd_bits": 1}),
    # issue 26: the Lloyd-Max grid with one scale per token each way, a token-sparse backward
    ("outlier LM 4b/1b", {**LM, "boundary.fwd_bits": 4, "boundary.bwd_bits": 1}),
    ("outlier LM 3b/1b", {**LM, "boundary.fwd_bits": 3, "boundary.bwd_bits": 1}),
    ("outlier LM 2b/1b T50", {**LM, "boundary.fwd_bits": 2, "boundary.bwd_bits": 1,
                              "boundary.outlier_bwd_tokens": 0.5}),
    # issue 36: KLT codes, 3 bits/dim on scored tokens and 1 on the others, 75% of the gradients at 1 bit
    ("klt 3/1b 1b T75", {"boundary.kind": "klt", "boundary.klt_bits": 3.0, "boundary.klt_context_bits": 1.0,
                         "boundary.klt_bwd_tokens": 0.75, "boundary.pca_batches": 16}),
    # issue 52: the same basis, an unbiased (dithered) entropy-coded forward, half of the gradients at 1 bit
    ("klt-dither 3.2/2b T50", {"boundary.kind": "klt-dither", "boundary.klt-dither.bits": 3.2,
                               "boundary.klt-dither.context_bits": 2.0, "boundary.pca_batches": 16}),
    ("mapl r=64 pca", {"boundary.kind": "mapl", "boundary.rank": 64, "boundary.init": "pca"}),
    ("mapl r=32 pca", {"boundary.kind": "mapl", "boundary.rank": 32, "boundary.init": "pca"}),
    ("ssn r=64", {"boundary.kind": "ssn", "boundary.rank": 64}),
]
# What the probe holds fixed whatever the config says: one replica, no anchor, no DP exchange.
PROBE_MESH = {"mesh.dp": 1, "mesh.anchor": 0, "dp.kind": "allreduce", "elastic.min_replicas": 1, "train.model_rank": 0}


def select_grid(kinds: list[str] | None, grid: list[tuple[str, dict]] = GRID) -> list[tuple[str, dict]]:
    """The dense arm and the arms of ``kinds`` (all when None)."""
    if not kinds:
        return list(grid)
    known = {s["boundary.kind"] for _, s in grid}
    unknown = [k for k in kinds if k not in known]
    if unknown:
        raise ConfigError(f"--kinds: no probe arms for {', '.join(unknown)}: choose from {', '.join(sorted(known))}")
    return [(a, s) for a, s in grid if s["boundary.kind"] == "identity" or s["boundary.kind"] in kinds]


def _grads(mesh: SimMesh, keep: bool = True) -> list[dict[str, torch.Tensor]]:
    """Per stage of replica 0: parameter name -> gradient (fp32, flat), then cleared from the stages.

    ``keep``: cloned, as the dense arm's gradients are, to outlive the mesh; otherwise views of the
    gradients the stages just let go (no copy): the caller's reference is then the only one, and
    dropping it frees the memory before the next backward allocates its own."""
    out = []
    for st in mesh.replicas[0]:
        g = {n: p.grad.detach().float().flatten() for n, p in st.named_parameters() if p.grad is not None}
        out.append({n: t.clone() for n, t in g.items()} if keep else g)
        st.zero_grad(set_to_none=True)
    return out


def cosine(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> tuple[float, list[float]]:
    """(overall, per stage) cosine of two gradients over the parameters both have (a learned
    boundary's own parameters exist in one of them only)."""
    dots, na, nb, per_stage = 0.0, 0.0, 0.0, []
    for ga, gb in zip(a, b):
        names = sorted(set(ga) & set(gb))
        d = sum(float(ga[n] @ gb[n]) for n in names)
        x, y = sum(float(ga[n] @ ga[n]) for n in names), sum(float(gb[n] @ gb[n]) for n in names)
        per_stage.append(d / math.sqrt(x * y) if x > 0 and y > 0 else float("nan"))
        dots, na, nb = dots + d, na + x, nb + y
    return (dots / math.sqrt(na * nb) if na > 0 and nb > 0 else float("nan")), per_stage


def exact_backward(boundary) -> None:
    """``boundary`` with its backward made exact: the activation gradient crosses whole (``Boundary``'s own
    ``encode_grad`` / ``decode_grad``), its forward untouched; the probe's ``cos_fwd`` pass."""
    size = boundary.hidden_size * 4
    boundary.encode_grad = types.MethodType(Boundary.encode_grad, boundary)
    boundary.decode_grad = types.MethodType(Boundary.decode_grad, boundary)
    kind_expect = boundary.payload_expect
    boundary.payload_expect = lambda direction, tokens, ctx=None: (
        Expect(max_bytes=tokens * size) if direction == "bwd" else kind_expect(direction, tokens, ctx))


def measure_arm(model, cfg: Config, device, batches: list[dict], train_ds, step_bar=None,
                dense_grads: list | None = None, exact_bwd: bool = False) -> dict:
    """One arm on ``batches``: mean loss, metered bytes per token each way, and per batch the
    gradient's cosine with ``dense_grads`` (the dense arm's per-batch gradients, ``_grads``).

    Without ``dense_grads`` this is the dense arm: it returns its own per-batch gradients
    (``grads``) and their cosines with themselves. With them, each batch's gradient is compared as
    soon as the backward leaves it and then dropped, so an arm holds one gradient at a time
    (docs/probe.md, Memory). The mesh (a copy of the model, ``build_stages``) is this function's
    alone: it is freed when the function returns. ``exact_bwd``: the boundaries' backward made exact
    (``exact_backward``)."""
    mesh = SimMesh(model, cfg, device)
    if exact_bwd:
        for b in mesh.boundaries:
            exact_backward(b)
    if any(b.wants_residual_init for b in mesh.boundaries):
        mesh.residual_start(residual_batches(cfg, train_ds))
    for st in mesh.replicas[0]:
        st.zero_grad(set_to_none=True)
    before = mesh.meter.snapshot()
    losses, grads, cosines, tokens = [], [], [], 0
    for i, batch in enumerate(batches):
        mesh.step_index = i  # a fresh mask (PRF of the step) per batch, as successive training steps see
        losses.append(mesh.forward_backward([batch]))
        if dense_grads is None:
            grads.append(_grads(mesh))
            cosines.append(cosine(grads[-1], grads[-1]))
        else:
            g = _grads(mesh, keep=False)
            cosines.append(cosine(g, dense_grads[i]))
            del g  # the only reference to this batch's gradient: free it before the next backward
        tokens += batch["input_ids"].numel()
        if step_bar is not None:
            step_bar.update(1)
    after = mesh.meter.snapshot()
    return {"loss": sum(losses) / len(losses), "cosines": cosines, **({"grads": grads} if dense_grads is None else {}),
            "fwd_bytes_per_token": (after["pp_fwd"] - before["pp_fwd"]) / tokens,
            "bwd_bytes_per_token": (after["pp_bwd"] - before["pp_bwd"]) / tokens, "tokens": tokens}


def _spec(base: Config, settings: dict):
    c = copy.deepcopy(base)
    apply_overrides(c, settings, source="probe")
    return c.boundary.spec()


def probe(cfg: Config, grid: list[tuple[str, dict]], num_batches: int = 4, boundaries: list[int] | None = None,
          progress: bool = True, loaded=None, forward_cosine: bool = True) -> dict:
    """The probe of every arm of ``grid`` on ``num_batches`` held-out batches (module docstring), on the configured
    model or on ``loaded`` (a run's trained model, ``probe --run``); ``forward_cosine``: each codec's ``cos_fwd``
    too (a second pass per arm; None without it)."""
    if num_batches < 1:
        raise ConfigError(f"--batches must be >= 1, got {num_batches}")
    if cfg.mesh.pp < 2:
        raise ConfigError("thinpipe probe needs at least one boundary: set mesh.pp >= 2")
    if boundaries is not None and any(not 0 <= b < cfg.mesh.pp - 1 for b in boundaries):
        raise ConfigError(f"--boundaries {boundaries}: boundaries are 0..{cfg.mesh.pp - 2} with mesh.pp = "
                          f"{cfg.mesh.pp}")
    base = copy.deepcopy(cfg)
    apply_overrides(base, PROBE_MESH, source="thinpipe probe")
    if boundaries is not None:
        base.boundary.masked = list(boundaries)
    device = place(base)
    if loaded is None:
        loaded = load(base)
    else:  # as load seeds it
        torch.manual_seed(base.train.seed)
    train_ds, val_ds = build_data(base, loaded.tokenizer)
    batches = [b for _, b in zip(range(num_batches), val_batches(val_ds, base.train.batch_size))]
    arms = [("dense", {"boundary.kind": "identity"})] + [(a, s) for a, s in grid if s["boundary.kind"] != "identity"]
    passes = len(arms) + forward_cosine * sum(1 for _, st in arms[1:] if not _spec(base, st).architectural)
    bar = tqdm(total=passes * len(batches), desc="probe", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    rows, dense = [], None
    for arm, settings in arms:
        c = copy.deepcopy(base)
        apply_overrides(c, settings, source=f"probe arm {arm!r}")
        c.validate()
        bar.set_postfix_str(arm)
        m = measure_arm(loaded.model, c, device, batches, train_ds, bar, None if dense is None else dense["grads"])
        gc.collect()  # should a kind ever hold its mesh (a model copy) in a cycle: free it before the next
        cos_fwd = None
        if dense is None:
            dense = m
        elif forward_cosine and not c.boundary.spec().architectural:  # a wire codec: forward and backward apart
            f = measure_arm(loaded.model, c, device, batches, train_ds, bar, dense["grads"], exact_bwd=True)
            cos_fwd = sum(c_ for c_, _ in f["cosines"]) / len(f["cosines"])
            gc.collect()
        per_batch = m["cosines"]
        stages = len(per_batch[0][1])
        pp = m["fwd_bytes_per_token"] + m["bwd_bytes_per_token"]
        dense_pp = dense["fwd_bytes_per_token"] + dense["bwd_bytes_per_token"]
        rows.append({"arm": arm, "kind": c.boundary.kind, "settings": {k: v for k, v in settings.items()},
                     "loss": m["loss"], "damage_nats": m["loss"] - dense["loss"],
                     "damage_rel": m["loss"] / dense["loss"] - 1.0,
                     "grad_cosine": sum(c_ for c_, _ in per_batch) / len(per_batch),
                     "grad_cosine_by_stage": [sum(s[i] for _, s in per_batch) / len(per_batch) for i in range(stages)],
                     "cos_fwd": 1.0 if m is dense else cos_fwd,
                     "fwd_bytes_per_token": m["fwd_bytes_per_token"], "bwd_bytes_per_token": m["bwd_bytes_per_token"],
                     "pp_bytes_per_token": pp, "pp_fraction": pp / dense_pp, "compression_x": dense_pp / pp})
    bar.close()
    return {"model": base.model.name, "pp": base.mesh.pp, "split": list(base.mesh.split), "data": base.data.name,
            "seq_len": base.train.seq_len, "batch_size": base.train.batch_size, "batches": len(batches),
            "tokens": dense["tokens"], "dtype": base.train.dtype, "boundaries": boundaries,
            "dense_loss": dense["loss"], "arms": rows}


def format_table(result: dict) -> str:
    lines = [f"{result['model']}, {result['pp']} stages, {result['batches']} held-out batches of {result['data']} "
             f"({result['tokens']} tokens), no training; dense loss {result['dense_loss']:.4f}",
             f"{'arm':<18}{'loss':>8}{'damage':>9}{'grad cos':>9}{'stage 0':>9}{'cos fwd':>9}{'fwd B/tok':>11}"
             f"{'bwd B/tok':>11}"
             f"{'x dense':>9}"]
    for r in result["arms"]:
        lines.append(f"{r['arm']:<18}{r['loss']:>8.4f}{r['damage_rel']:>+9.1%}{r['grad_cosine']:>9.3f}"
                     f"{r['grad_cosine_by_stage'][0]:>9.3f}"
                     f"{'-' if r['cos_fwd'] is None else format(r['cos_fwd'], '.3f'):>9}"
                     f"{r['fwd_bytes_per_token']:>11.1f}"
                     f"{r['bwd_bytes_per_token']:>11.1f}{r['compression_x']:>8.1f}x")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Loss against PP bytes per token: the frontier before training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    kinds = sorted({r["kind"] for r in result["arms"]})
    for kind in kinds:
        pts = [r for r in result["arms"] if r["kind"] == kind]
        ax.plot([r["pp_bytes_per_token"] for r in pts], [r["loss"] for r in pts], "o-" if len(pts) > 1 else "o",
                label=kind)
        for r in pts:
            ax.annotate(r["arm"], (r["pp_bytes_per_token"], r["loss"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.axhline(result["dense_loss"], color="k", lw=0.8, ls="--", label="dense")
    ax.set_xscale("log")
    ax.set_xlabel("PP bytes per token (forward + backward, all boundaries)")
    ax.set_ylabel("held-out loss, no training (nats/token)")
    ax.set_title(f"probe: {result['model']}, {result['pp']} stages")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "probe.png")
