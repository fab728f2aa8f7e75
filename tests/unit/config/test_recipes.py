"""Recipes (``thinpipe train --recipe``, ``thinpipe recipes``) and each objective's optimizer defaults (issue 39)."""

import json
import subprocess
import sys
import tomllib

import pytest

from thinpipe.cli import main
from thinpipe.config import ConfigError, load_config
from thinpipe.config.post import OBJECTIVE_DEFAULTS
from thinpipe.config.recipe import recipe_names

# a tiny model and short sequences under every recipe: the recipe's system, not its model or batch, is tested
TINY = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "train.seq_len=32",
        "--set", "data.val_rows=4", "--set", "train.batch_size=4", "--set", "train.microbatches=2"]
# what issue 39 says `anchor-priors` resolves to (Table 2's K, tau, alpha included)
ANCHOR_PRIORS = {("boundary", "kind"): "mask", ("boundary", "p"): 0.95, ("mesh", "anchor"): 1,
                 ("anchor", "delivery"): "arrival", ("dp", "kind"): "streaming-diloco", ("anchor", "staleness"): 20,
                 ("optim", "spectral", "tau"): 1e-3, ("optim", "spectral", "alpha"): 0.3}


def _at(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def test_recipes_lists_every_recipe_with_its_line(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert set(recipe_names()) >= {"anchor-priors", "mapl", "best-quality"}
    for name in recipe_names():
        line = next(x for x in out.splitlines() if x.startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 20, line  # a real description
    assert main(["recipes", "mapl"]) == 0
    assert 'kind = "mapl"' in capsys.readouterr().out


def test_anchor_priors_resolves_to_the_papers_system():
    cfg = load_config(recipe="anchor-priors").to_dict()
    for path, value in ANCHOR_PRIORS.items():
        assert _at(cfg, path) == value, path
    assert cfg["anchor"]["push_rank"] > 0 and cfg["dp"]["rank"] > 0
    assert cfg["mesh"]["dp"] > 1  # DP is there to compress


def test_config_and_set_override_a_recipe_and_an_unknown_recipe_is_one_line(tmp_path, capsys):
    (tmp_path / "mine.toml").write_text("[boundary]\np = 0.9\n")
    cfg = load_config(tmp_path / "mine.toml", ["mesh.dp=1"], recipe="anchor-priors")
    assert (cfg.boundary.p, cfg.mesh.dp, cfg.boundary.kind) == (0.9, 1, "mask")
    with pytest.raises(ConfigError, match="did you mean anchor-priors"):
        load_config(recipe="anchor-prior")
    assert main(["train", "--recipe", "nope", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a recipe" in err[0] and "thinpipe recipes" in err[0]
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("objective", sorted(OBJECTIVE_DEFAULTS))
def test_an_objective_takes_its_own_optimizer_defaults_unless_the_user_sets_them(objective, tmp_path):
    defaults = OBJECTIVE_DEFAULTS[objective]
    cfg = load_config(None, [f"train.objective={objective}"]).to_dict()["train"]
    assert {k: cfg[k.split(".")[1]] for k in defaults} == defaults
    assert load_config().train.lr == 2e-5  # SFT keeps App. I.3's
    # a key the user gives wins, by --set or in a --config file; the others stay the objective's
    cfg = load_config(None, [f"train.objective={objective}", "train.lr=3e-6"])
    assert cfg.train.lr == 3e-6 and cfg.train.grad_clip == defaults["train.grad_clip"]
    (tmp_path / "c.toml").write_text(f'[train]\nobjective = "{objective}"\nweight_decay = 0.05\n')
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.train.weight_decay == 0.05 and cfg.train.lr == defaults["train.lr"]
    # a run's own config.toml (what --resume reads) names every key: nothing is replaced there
    saved = load_config(None, [f"train.objective={objective}"])
    saved.train.lr = 5e-6
    (tmp_path / "saved.toml").write_text(saved.to_toml())
    assert load_config(tmp_path / "saved.toml").train.lr == 5e-6


def test_gspo_defaults_are_app_d5():
    t = load_config(None, ["train.objective=gspo"]).train
    assert (t.lr, t.weight_decay, t.grad_clip, t.warmup_ratio) == (1e-6, 0.1, 1.0, 0.05)


@pytest.mark.slow
@pytest.mark.parametrize("name", recipe_names())
def test_each_recipe_trains_and_writes_its_settings_into_the_runs_config(name, tmp_path):
    """Every shipped recipe trains (on a tiny model: a recipe is a system, not a model) and its values are in the
    run's resolved config.toml."""
    out = tmp_path / name
    sets = {"mapl": ["--set", "boundary.rank=16"],
            "anchor-priors": ["--set", "anchor.staleness=2"]}.get(name, [])
    assert main(["train", "--recipe", name, "--out", str(out), "--quiet", *TINY, "--set", "train.steps=4",
                 *sets]) == 0
    written = tomllib.loads((out / "config.toml").read_text())
    recipe = load_config(recipe=name).to_dict()
    changed = {"model": {"name", "tokenizer"}, "data": {"name", "val_rows"}, "train": {"seq_len", "steps",
               "batch_size", "microbatches", "dtype"}, "boundary": {"rank"}, "anchor": {"staleness"}}
    for section, keys in recipe.items():
        for key, value in keys.items():
            if key not in changed.get(section, ()):
                assert written[section][key] == value, (section, key)
    # `thinpipe compare` reads the run (DPO / GSPO runs: tests/integration/test_post_sft_train.py)
    from thinpipe.commands.compare import compare

    row = compare([out])["runs"][0]
    summary = json.loads((out / "summary.json").read_text())
    assert row["measure"] == "val_loss" and row["final_val_loss"] == summary["final_val_loss"]


@pytest.mark.dist
def test_anchor_priors_recipe_on_real_processes(tmp_path):
    """`thinpipe launch` reads the recipe as the ranks do: its mesh (here 2 replicas x 2 stages + the anchor row:
    6 processes) and its settings, in config.toml."""
    out = tmp_path / "ap"
    r = subprocess.run([sys.executable, "-m", "thinpipe", "launch", "--nproc", "6", "--", "train", "--recipe",
                        "anchor-priors", "--out", str(out), "--quiet", *TINY, "--set", "train.steps=6",
                        "--set", "mesh.pp=2", "--set", "anchor.staleness=2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    written = tomllib.loads((out / "config.toml").read_text())
    for path, value in ANCHOR_PRIORS.items():
        if path != ("anchor", "staleness"):
            assert _at(written, path) == value, path
    assert written["anchor"]["push_rank"] > 0 and written["dp"]["rank"] > 0
    assert "steps" in (out / "summary.json").read_text()
