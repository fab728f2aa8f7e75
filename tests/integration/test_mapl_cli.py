"""MAPL end to end through the CLI: training, PCA start, the analyze command, clear refusals."""

import json

import pytest
import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.cli import main
from thinpipe.engine.sim_mesh import SimMesh

ARGS = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "mesh.pp=4",
        "--set", "train.steps=4", "--set", "train.batch_size=2", "--set", "train.seq_len=32",
        "--set", "eval.every=2", "--set", "boundary.rank=16"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mapl", "mapl-vq", "ssn"])
def test_train_then_analyze(kind, tmp_path, capsys):
    run = tmp_path / kind
    assert main(["train", "--out", str(run), "--quiet", *ARGS, "--set", f"boundary.kind={kind}"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["pp_fwd_bytes"] > 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "captured_energy" in rows[1] and len(rows[1]["captured_energy"]["learned"]) == 3
    assert main(["analyze", "--run", str(run), "--batches", "1"]) == 0
    result = json.loads((run / "analysis" / "analysis.json").read_text())
    assert len(result["boundaries"]) == 3 and (run / "analysis" / "spectra.png").is_file()
    b0 = result["boundaries"][0]
    assert 0 <= b0["captured_energy"] <= b0["captured_energy_best"] + 1e-9
    assert len(result["principal_angles_deg"]) == 3 and (run / "analysis" / "projectors.png").is_file()
    assert "principal angles" in capsys.readouterr().out
    # the boundaries are part of the model: no silent export without them; MC eval runs through them
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 2
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--tasks", "arc_easy", "--limit", "4", "--json"]) == 0
    printed = capsys.readouterr().out  # a first run may also print the benchmark download
    assert json.loads(printed[printed.index("[\n"):])[0]["n"] == 4


def test_pca_start_captures_more_energy_than_random_and_keeps_the_manifold():
    model = tiny_model()
    batches = [tiny_batch(batch_size=2, seq_len=32, seed=s) for s in range(3)]
    cfg = config(model__name="tiny-llama", mesh__pp=4, boundary__kind="mapl", boundary__rank=8)
    rand = SimMesh(model, cfg)
    pca = SimMesh(model, config(model__name="tiny-llama", mesh__pp=4, boundary__kind="mapl", boundary__rank=8,
                                boundary__init="pca"))
    pca.residual_start(batches)
    from thinpipe.analysis import captured_energy
    from thinpipe.optim.stiefel import stiefel_error
    for b, X_r, X_p in zip(pca.boundaries, rand.boundary_residuals(batches), pca.boundary_residuals(batches)):
        A = b.projector.A.detach()
        assert stiefel_error(A) < 1e-5 and torch.equal(b.A_copy.detach(), A)
        assert captured_energy(X_p, A) > captured_energy(X_r, rand.boundaries[b.index].projector.A.detach())
    assert pca.eval_loss(batches[0])[0] < rand.eval_loss(batches[0])[0]
