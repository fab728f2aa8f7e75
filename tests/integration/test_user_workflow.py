"""Issue 18 end to end: a user's chat file with their model's template, a second phase from a first
run's weights (--init-from), TensorBoard files read back by tensorboard's own reader, `compare`."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.chat_families import model_folder  # noqa: E402
from thinpipe.cli import main  # noqa: E402

SAMPLE = Path(__file__).parents[1] / "fixtures" / "chat_sample.jsonl"
SMALL = ["--set", "train.steps=3", "--set", "mesh.pp=2", "--set", "train.seq_len=64", "--set", "train.batch_size=2",
         "--set", "data.val_fraction=0.2"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("THINPIPE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_a_users_chat_file_trains_with_the_models_own_template(tmp_path, family):
    folder = model_folder(family, tmp_path / family)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--quiet", "--set", f"model.name={folder}", "--set",
                 f"data.name={SAMPLE}", "--set", "data.chat_format=template", *SMALL]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 3 and s["final_val_loss"] < s["initial_val_loss"] + 1.0
    saved = (out / "config.toml").read_text()
    assert f'name = "{SAMPLE.resolve()}"' in saved and 'chat_format = "template"' in saved


def test_a_template_refusing_a_row_is_one_line_naming_file_and_line(tmp_path, capsys):
    folder = model_folder("mistral", tmp_path / "mistral")  # v0.1's template refuses system turns (row 1 has one)
    code = main(["train", "--out", str(tmp_path / "run"), "--quiet", "--set", f"model.name={folder}", "--set",
                 f"data.name={SAMPLE}", *SMALL])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"error: {SAMPLE.resolve()}:1: the model's chat template refuses")


def test_bad_data_paths_are_one_line_before_loading(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "r"), "--set", "data.name=./nope.jsonl"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_init_from_a_run_starts_phase_two_from_its_weights_with_a_fresh_schedule(tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i}: " + "abc " * (i % 9 + 1)}) + "\n" for i in range(60)))
    one, two = tmp_path / "cpt", tmp_path / "sft"
    tiny = ["--set", "model.name=tiny-llama", "--set", "mesh.pp=2", "--set", "train.seq_len=64",
            "--set", "train.batch_size=2", "--set", "train.lora.rank=4"]
    assert main(["train", "--out", str(one), "--quiet", *tiny, "--set", f"data.name={text}",
                 "--set", "train.steps=4"]) == 0
    assert main(["train", "--out", str(two), "--quiet", *tiny, "--init-from", str(one), "--set",
                 f"data.name={SAMPLE}", "--set", "train.steps=4", "--set", "train.warmup_ratio=0.5"]) == 0
    from thinpipe.engine.run_folder import load_run

    _, merged, _ = load_run(one)  # phase one's weights, its LoRA merged
    init = load_file(two / "init" / "model.safetensors")
    ref = merged.state_dict()
    assert set(init) <= set(ref) and all(torch.equal(init[k], ref[k]) for k in init)
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and rows[0]["lr"] < rows[1]["lr"]  # warming up again: a fresh schedule
    saved = (two / "config.toml").read_text()
    assert f'init_from = "{one.resolve()}"' in saved and f'name = "{(two / "init").resolve()}"' in saved
    # an HF folder works too, and --init-from with --resume is refused
    assert main(["train", "--out", str(tmp_path / "hf"), "--quiet", "--init-from", str(two / "init"), "--set",
                 "train.steps=1", "--set", "mesh.pp=2", "--set", "data.name=synthetic"]) == 0
    assert main(["train", "--out", str(two), "--resume", "--init-from", str(one)]) == 2


def test_tensorboard_holds_every_scalar_of_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--quiet", "--set", "model.name=tiny-llama", "--set", "mesh.pp=2",
                 "--set", "data.name=synthetic", "--set", "train.steps=4", "--set", "eval.every=2",
                 "--set", "log.tensorboard=true", "--set", "boundary.kind=mask", "--set", "boundary.p=0.5"]) == 0
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        for k, v in row.items():
            if k == "step" or not isinstance(v, (int, float)):
                continue
            got = {e.step: e.value for e in acc.Scalars(k)}
            assert got[row["step"]] == pytest.approx(v, rel=1e-6), k
    assert {"loss", "lr", "grad_norm", "pp_fwd_bytes", "pp_bwd_bytes", "val_loss"} <= tags
    summary = json.loads((out / "summary.json").read_text())
    assert acc.Scalars("summary/final_val_loss")[0].value == pytest.approx(summary["final_val_loss"], rel=1e-6)


def test_wandb_and_trackio_get_the_same_scalars_when_installed(tmp_path, monkeypatch):
    logged = {"wandb": [], "trackio": []}

    class Run:
        def define_metric(self, name, **kw):
            pass

        def log(self, values):
            logged["wandb"].append((values.pop("thinpipe/step"), values))

        def finish(self):
            logged["wandb"].append("finished")

    fake_wandb = types.SimpleNamespace(init=lambda **kw: logged["wandb"].append(kw["mode"]) or Run())
    fake_trackio = types.SimpleNamespace(init=lambda **kw: None,
                                         log=lambda v, step: logged["trackio"].append((step, v)),
                                         finish=lambda: logged["trackio"].append("finished"))
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setitem(sys.modules, "trackio", fake_trackio)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    from thinpipe.config import Config
    from thinpipe.dashboards import Dashboards

    cfg = Config()
    cfg.log.wandb = cfg.log.trackio = True
    d = Dashboards(cfg, tmp_path, 0)
    d.log({"step": 3, "loss": 1.5, "diag": {"cos": 0.5}, "flag": True})
    d.close()
    run_id = (tmp_path / "wandb" / "thinpipe_run_id").read_text()
    from thinpipe.dashboards import _wandb_id
    assert _wandb_id(tmp_path, 5) == run_id and _wandb_id(tmp_path, 0) != run_id  # resume continues, a new run not
    assert logged["wandb"] == ["offline", (3, {"loss": 1.5, "diag/cos": 0.5}), "finished"]
    assert logged["trackio"] == [(3, {"loss": 1.5, "diag/cos": 0.5}), "finished"]


def test_a_dashboard_that_is_not_installed_is_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["train", "--out", str(tmp_path / "r"), "--set", "log.wandb=true"]) == 2
    assert "log.wandb = true but wandb is not installed: pip install wandb" in capsys.readouterr().err


@pytest.mark.slow
def test_the_chat_sample_trains_on_smollm2_with_its_own_template(tmp_path):
    """Issue 18's "done when": a user's JSONL chat file, the default model, the model's own template."""
    from thinpipe.data import build_dataset
    from thinpipe.models.loading import load_tokenizer
    from thinpipe.models.loading import model_folder as smollm2_folder

    tok = load_tokenizer(smollm2_folder("smollm2-135m"))
    ds = build_dataset(str(SAMPLE), tok, 256, "train", 0, chat_format="template", val_fraction=0.2)
    row, labels = ds.rows(0)["input_ids"], ds.rows(0)["labels"]
    text = tok.decode(row.tolist())
    assert "You are a helpful AI assistant named SmolLM" in text or "You are a concise math tutor." in text
    learned = tok.decode(labels[labels >= 0].tolist())
    assert "<|im_start|>" not in learned and "What is" not in learned and " = " in learned
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--quiet", "--set", f"data.name={SAMPLE}", "--set",
                 "data.chat_format=template", "--set", "train.steps=2", "--set", "mesh.pp=2", "--set",
                 "train.seq_len=256", "--set", "train.batch_size=2", "--set", "data.val_fraction=0.2",
                 "--set", "model.tied=untie"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 2 and s["final_val_loss"] < 5.0


@pytest.mark.slow
def test_compare_tables_and_plots_runs_against_the_dense_one(tmp_path, capsys):
    base = ["--quiet", "--set", "model.name=tiny-llama", "--set", "mesh.pp=2", "--set", "data.name=synthetic",
            "--set", "train.steps=4", "--set", "eval.every=2", "--set", "train.seq_len=32"]
    assert main(["train", "--out", str(tmp_path / "dense"), *base]) == 0
    assert main(["train", "--out", str(tmp_path / "m75"), *base, "--set", "boundary.kind=mask",
                 "--set", "boundary.p=0.75"]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "m75"), str(tmp_path / "dense"), "--out", str(tmp_path / "cmp")]) == 0
    table = capsys.readouterr().out
    assert "m75" in table and "dense" in table and "4.0x" in table  # p = 0.75 keeps a quarter of the dims
    got = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert got["dense"] == "dense" and (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000
    m75, dense = got["runs"]
    for r in (m75, dense):
        s = json.loads((tmp_path / r["run"] / "summary.json").read_text())
        assert r["final_val_loss"] == s["final_val_loss"] and r["best_val_loss"] == min(v for _, v in s["val_points"])
    assert m75["pp_compression"] == pytest.approx(dense["pp_bytes_per_token"] / m75["pp_bytes_per_token"])
    assert m75["vs_dense_final"] == pytest.approx(m75["final_val_loss"] / dense["final_val_loss"] - 1)
    # a run still training compares from its metrics so far; a folder that is no run is one line
    (tmp_path / "m75" / "summary.json").unlink()
    assert main(["compare", str(tmp_path / "m75"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["finished"] is False
    assert main(["compare", str(tmp_path / "cmp")]) == 2
    assert "not a thinpipe run folder" in capsys.readouterr().err
