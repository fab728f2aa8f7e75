"""Post-hoc global magnitude pruning (anchor-priors §5.5)."""

import json

import pytest
import torch

from tests.helpers import tiny_model
from thinpipe.cli import main
from thinpipe.commands.prune_lib import global_magnitude_prune, parse_sparsities, prunable
from thinpipe.config import ConfigError


@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.37, 0.5, 0.9])
def test_pruning_reaches_the_requested_sparsity_exactly_and_removes_the_smallest(sparsity):
    model = tiny_model("llama")
    before = {n: p.detach().clone() for n, p in prunable(model)}
    total = sum(p.numel() for p in before.values())
    stats = global_magnitude_prune(model, sparsity)
    k = round(sparsity * total)
    zeros = sum(int((p == 0).sum()) for _, p in prunable(model))
    assert stats["pruned"] == k and zeros == k == stats["zeros"]
    # global: every removed weight is no larger than every kept one
    removed = torch.cat([before[n][p == 0].abs() for n, p in prunable(model)])
    kept = torch.cat([before[n][p != 0].abs() for n, p in prunable(model)])
    if k and kept.numel():
        assert removed.max() <= kept.min()
    # only decoder matrices: embeddings, head and norms untouched
    assert all(".layers." in f".{n}" for n in before)
    assert torch.count_nonzero(model.model.embed_tokens.weight) == model.model.embed_tokens.weight.numel()


def test_ties_are_broken_so_the_count_stays_exact():
    model = tiny_model("llama")
    with torch.no_grad():
        for _, p in prunable(model):
            p.fill_(0.5)  # every weight ties
    stats = global_magnitude_prune(model, 0.25)
    assert stats["zeros"] == stats["pruned"] == round(0.25 * stats["prunable"])


def test_bad_sparsities_are_refused():
    assert parse_sparsities("0, 0.2,0.5") == [0.0, 0.2, 0.5]
    for bad in ("1.0", "-0.1", "abc", ""):
        with pytest.raises(ConfigError, match="--sparsity"):
            parse_sparsities(bad)


@pytest.mark.slow
def test_prune_cli_sweeps_a_run_and_loss_grows_with_sparsity(tmp_path, capsys):
    run = tmp_path / "run"
    sets = ["model.name=tiny-llama", "data.name=synthetic", "train.steps=20", "train.batch_size=4",
            "train.seq_len=32", "data.val_rows=8", "train.lr=3e-3"]
    assert main(["train", "--out", str(run), "--quiet", *[x for s in sets for x in ("--set", s)]]) == 0
    capsys.readouterr()
    assert main(["prune", "--run", str(run), "--sparsity", "0,0.5,0.9"]) == 0
    out = capsys.readouterr().out
    assert "held-out" in out
    rows = json.loads((run / "prune" / "prune.json").read_text())["rows"]
    trained = json.loads((run / "summary.json").read_text())["final_val_loss"]
    assert rows[0]["val_loss"] == pytest.approx(trained, rel=1e-5)  # sparsity 0 == the run's own number
    assert rows[0]["val_loss"] < rows[2]["val_loss"]
    assert (run / "prune" / "prune.png").is_file()
    assert main(["prune", "--run", str(tmp_path / "nope")]) == 2
