"""``thinpipe analyze --run DIR``: MAPL's boundary figures for one run, as JSON and PNG plots.

Works for every boundary kind: spectra (Fig. 3) and stable ranks (App. D) for all; principal
angles, captured energy (learned vs a fixed random basis of the same rank) and cosine preservation
(Fig. 4) for runs whose boundaries have a projector (MAPL, MAPL+VQ; SSN's shared basis)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from thinpipe.analysis.subspace import (  # noqa: E402
    captured_energy,
    cosine_preservation,
    cumulative_energy,
    principal_angle_deg,
    rank_for_energy,
    singular_values,
    stable_rank,
)
from thinpipe.data import batches as batch_stream  # noqa: E402
from thinpipe.engine.run_folder import load_mesh  # noqa: E402
from thinpipe.objective.registry import build_data  # noqa: E402
from thinpipe.optim.stiefel import orthonormal  # noqa: E402


def adjacent_stable_ranks(stage) -> dict[str, float]:
    """Stable rank of the attention output and MLP down projection of the stage's last layer
    (the layers that write the boundary activation)."""
    last = list(stage.layers.values())[-1]
    return {"o_proj": stable_rank(last.self_attn.o_proj.weight), "down_proj": stable_rank(last.mlp.down_proj.weight)}


def analyze_mesh(mesh, batches: list[dict], seed: int = 0) -> dict:
    residuals = mesh.boundary_residuals(batches)
    out: dict = {"boundaries": []}
    projectors = []
    for b, X in zip(mesh.boundaries, residuals):
        s = singular_values(X)
        row = {"index": b.index, "kind": b.kind, "tokens": X.shape[0], "hidden": X.shape[1],
               "singular_values": s.tolist(), "cumulative_energy": cumulative_energy(s).tolist(),
               "rank_for_90": rank_for_energy(s, 0.90), "rank_for_99": rank_for_energy(s, 0.99),
               "stable_rank": adjacent_stable_ranks(mesh.replicas[0][b.index])}
        A = b.subspace()
        if A is not None:
            fixed = orthonormal(A.shape[0], A.shape[1], torch.Generator().manual_seed(seed + 17 + b.index))
            full, proj, r = cosine_preservation(X, A, seed=seed)
            row.update(rank=A.shape[1], captured_energy=captured_energy(X, A),
                       captured_energy_fixed_random=captured_energy(X, fixed),
                       captured_energy_best=float(cumulative_energy(s)[A.shape[1] - 1]),
                       cosine_pearson=r, cosine_pairs={"full": full[:500].tolist(), "projected": proj[:500].tolist()})
            projectors.append(A)
        out["boundaries"].append(row)
    if len(projectors) > 1:
        n = len(projectors)
        out["principal_angles_deg"] = [[principal_angle_deg(projectors[i], projectors[j]) for j in range(n)]
                                       for i in range(n)]
    return out


def plot_analysis(result: dict, out: Path, title: str) -> list[Path]:
    paths = []
    rows = result["boundaries"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        ax[0].semilogy(row["singular_values"], label=f"boundary {row['index']}")
        ax[1].plot(range(1, len(row["cumulative_energy"]) + 1), row["cumulative_energy"],
                   label=f"boundary {row['index']}")
    ax[0].set(xlabel="index", ylabel="singular value", title="spectrum of X - offset (Fig. 3a)")
    ax[1].set(xlabel="rank r", ylabel="E(r)", title="cumulative energy (Fig. 3b)")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(out / "spectra.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    with_proj = [r for r in rows if "captured_energy" in r]
    if with_proj:
        fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
        angles = result.get("principal_angles_deg")
        if angles:
            im = ax[0].imshow(angles, vmin=0, vmax=90, cmap="viridis")
            fig.colorbar(im, ax=ax[0])
            ax[0].set(title="mean principal angle, degrees (Fig. 4a)", xlabel="boundary", ylabel="boundary",
                      xticks=range(len(angles)), yticks=range(len(angles)))
        idx = [r["index"] for r in with_proj]
        w = 0.27
        ax[1].bar([i - w for i in idx], [r["captured_energy"] for r in with_proj], w, label="this run's projector")
        ax[1].bar(idx, [r["captured_energy_fixed_random"] for r in with_proj], w, label="fixed random basis")
        ax[1].bar([i + w for i in idx], [r["captured_energy_best"] for r in with_proj], w, label="top-r PCA (bound)")
        ax[1].set(title="captured energy ||XA||^2/||X||^2 (Fig. 4b)", xlabel="boundary", ylim=(0, 1), xticks=idx)
        ax[1].legend(fontsize=7)
        r0 = with_proj[0]
        ax[2].scatter(r0["cosine_pairs"]["full"], r0["cosine_pairs"]["projected"], s=3, alpha=0.4)
        ax[2].plot([-1, 1], [-1, 1], "k--", lw=0.8)
        ax[2].set(title=f"boundary {r0['index']}: cosine preservation, r = {r0['cosine_pearson']:.3f} (Fig. 4c)",
                  xlabel="cos(x_i, x_j)", ylabel="cos(x_i A, x_j A)")
        for a in ax[1:]:
            a.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out / "projectors.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def analyze_run(run: str | Path | list, batches: int = 4, device: str = "cpu") -> tuple[dict, list[Path]]:
    """The boundaries of a run of any engine (a dist job's machines' folders, a list: written into the first)."""
    runs = [Path(r) for r in run] if isinstance(run, list) else [Path(run)]
    cfg, mesh, loaded = load_mesh(runs if len(runs) > 1 else runs[0], device)
    run = runs[0]
    _, val = build_data(cfg, loaded.tokenizer)
    stream = batch_stream(val, cfg.train.batch_size, cfg.train.seed)
    data = [next(stream) for _ in range(batches)]
    result = analyze_mesh(mesh, data, seed=cfg.train.seed)
    result["run"] = str(run)
    result["step"] = mesh.step_index
    out = run / "analysis"
    out.mkdir(exist_ok=True)
    (out / "analysis.json").write_text(json.dumps(result))
    title = f"{run.name}: {cfg.boundary.kind}" + (f" r={cfg.boundary.rank}" if mesh.boundaries[0].subspace() is not None
                                                  else "")
    return result, plot_analysis(result, out, title)
