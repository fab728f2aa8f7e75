"""The CUDA side of issue 15's promises (marker ``gpu``; skipped where CUDA is absent).

Run by ``benchmarks/gpu_check.sh`` on a GPU machine. Tolerances: CPU and CUDA fp32 kernels round
differently (matmul accumulation order, SDPA), so a run on one is not bitwise a run on the other;
over a few steps of a tiny model the losses agree to ``LOSS_TOL``. What does not depend on
rounding is exact: the PRF's indices, bytes per axis, payload shapes. On one device, two runs of
one config are bitwise equal with ``train.deterministic = true``, and the dist engine on CUDA
equals the simulation on CUDA to ``DIST_TOL`` (their reductions run on the host in rank order;
the stage kernels are the same calls on the same device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import config, engine_step, tiny_batch, tiny_model
from thinpipe.boundary.prf import keep_indices
from thinpipe.comm.meter import AXES
from thinpipe.engine.sim_engine import SimEngine, train
from thinpipe.engine.sim_mesh import SimMesh

# THINPIPE_GPU_TESTS_ON=cpu runs every test here with "cpu" in place of "cuda" (the plumbing, on a
# machine without a GPU: comparisons are then trivially equal; benchmarks/gpu_check.sh --dry-run).
GPU = os.environ.get("THINPIPE_GPU_TESTS_ON", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPU == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")]

LOSS_TOL = 2e-3   # |loss_cuda - loss_cpu| over a few steps of a tiny fp32 model
DIST_TOL = 1e-5
CUDA, CPU = torch.device(GPU, 0) if GPU == "cuda" else torch.device("cpu"), torch.device("cpu")

BASE = dict(model__name="tiny-llama", data__name="synthetic", train__steps=3, train__batch_size=2,
            train__seq_len=32, train__microbatches=2, train__lr=1e-3, train__checkpoint_every=0,
            train__dtype="float32")
# every boundary kind (with what it needs), the anchor circuit with spectral correction, LoRA
CASES = {
    "identity": dict(mesh__pp=2),
    "mask": dict(mesh__pp=2, boundary__kind="mask"),
    "topk": dict(mesh__pp=2, boundary__kind="topk"),
    "quant4": dict(mesh__pp=2, boundary__kind="quant4"),
    "quant2": dict(mesh__pp=2, boundary__kind="quant2"),
    "aqsgd": dict(mesh__pp=2, boundary__kind="aqsgd", data__max_examples=2, train__steps=4),
    "tahquant": dict(mesh__pp=2, boundary__kind="tahquant"),
    "bottleneck": dict(mesh__pp=2, boundary__kind="bottleneck", boundary__p=0.75),
    "ssn": dict(mesh__pp=3, boundary__kind="ssn", boundary__rank=16, boundary__ssn_refresh_every=2),
    "mapl": dict(mesh__pp=2, boundary__kind="mapl", boundary__rank=16),
    "mapl-vq": dict(mesh__pp=2, boundary__kind="mapl-vq", boundary__rank=16, boundary__vq_codes=32,
                    boundary__vq_sync_codes=4),
    "mask + AP + PowerSGD": dict(mesh__pp=2, mesh__dp=2, mesh__anchor=1, boundary__kind="mask", dp__kind="powersgd",
                                 dp__start_step=1, anchor__staleness=2, anchor__every=1, anchor__push_rank=2,
                                 train__steps=5),
    "LoRA + streaming DiLoCo": dict(mesh__pp=2, mesh__dp=2, train__lora__rank=4, dp__kind="streaming-diloco",
                                    dp__inner_steps=2, dp__fragments=2, train__steps=4),
}


def run_folder(tmp_path: Path, name: str, **sets) -> tuple[list[float], dict]:
    out = tmp_path / name
    summary = train(config(**{**BASE, **sets}), out, progress=False)
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    return losses, summary


def test_prf_indices_are_the_same_on_cuda_and_cpu():
    for key, tokens, hidden, keep in [(7, 64, 576, 29), (123456789, 300, 64, 3), (0, 5, 2048, 1024)]:
        assert torch.equal(keep_indices(key, tokens, hidden, keep, CUDA).cpu(), keep_indices(key, tokens, hidden, keep))


@pytest.mark.parametrize("kind", ["identity", "mask", "topk", "quant4", "quant2", "aqsgd", "tahquant", "bottleneck",
                                  "mapl", "mapl-vq"])
def test_every_codec_round_trips_on_cuda(kind):
    """One forward-backward through each boundary on both devices: the same bytes, payload for
    payload, and the same loss and gradients to rounding."""
    sets = {k.replace("__", "."): v for k, v in CASES[kind].items() if k.startswith("boundary")}
    model = tiny_model("llama")
    results = {}
    for device in dict.fromkeys((CPU, CUDA)):
        mesh = SimMesh(model, config(**{**BASE, **CASES[kind]}), device)
        batch = tiny_batch(batch_size=2, seq_len=32)
        loss = mesh.forward_backward([batch])
        grads = {n: p.grad.detach().cpu() for st in mesh.replicas[0] for n, p in st.named_parameters()
                 if p.grad is not None}
        results[device] = (loss, dict(mesh.meter.totals), grads)
    (l0, b0, g0), (l1, b1, g1) = results.values() if len(results) == 2 else (results[CPU], results[CPU])
    assert b0 == b1, sets
    assert abs(l0 - l1) < 1e-4 * max(1.0, abs(l0))
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-3, atol=1e-5, msg=f"{kind}: {n}")


@pytest.mark.parametrize("case", list(CASES))
def test_sim_on_cuda_equals_sim_on_cpu_to_rounding(tmp_path, case):
    cpu_losses, cpu = run_folder(tmp_path, "cpu", train__device="cpu", **CASES[case])
    cuda_losses, cuda = run_folder(tmp_path, "cuda", train__device=GPU, **CASES[case])
    assert {a: cuda[f"{a}_bytes"] for a in AXES} == {a: cpu[f"{a}_bytes"] for a in AXES}
    assert len(cuda_losses) == len(cpu_losses)
    for step, (a, b) in enumerate(zip(cpu_losses, cuda_losses)):
        assert abs(a - b) < LOSS_TOL, f"{case}: step {step}: cpu {a} vs cuda {b}"
    assert abs(cpu["final_val_loss"] - cuda["final_val_loss"]) < LOSS_TOL


def test_two_deterministic_runs_on_cuda_are_bitwise_equal(tmp_path):
    sets = dict(train__device=GPU, train__deterministic=True, **CASES["mask + AP + PowerSGD"])
    a, sa = run_folder(tmp_path, "a", **sets)
    b, sb = run_folder(tmp_path, "b", **sets)
    assert a == b and sa["final_val_loss"] == sb["final_val_loss"]


def test_bf16_is_the_default_on_cuda_and_halves_the_pp_bytes(tmp_path):
    losses, bf16 = run_folder(tmp_path, "auto", train__device=GPU, train__dtype="auto", train__steps=20,
                              mesh__pp=2)
    expected = "bfloat16" if GPU == "cuda" else "float32"
    assert f'dtype = "{expected}"' in (tmp_path / "auto" / "config.toml").read_text()
    _, fp32 = run_folder(tmp_path, "fp32", train__device=GPU, train__steps=20, mesh__pp=2)
    assert bf16["pp_fwd_bytes"] * (2 if GPU == "cuda" else 1) == fp32["pp_fwd_bytes"]
    assert bf16["final_val_loss"] < bf16["initial_val_loss"]      # it trains


@pytest.mark.parametrize("first, then", [(GPU, "cpu"), ("cpu", GPU)])
def test_a_run_resumes_on_the_other_device(tmp_path, first, then):
    """Save after 2 steps on one device, load on the other, 2 more steps: the same trajectory as 4
    steps on the first device, to rounding (bytes exactly)."""
    sets = {**BASE, **CASES["mask + AP + PowerSGD"], "train__steps": 4}
    whole = SimEngine(config(**sets, train__device=first))
    reference = [engine_step(whole, s) for s in range(4)]
    a = SimEngine(config(**sets, train__device=first))
    part = [engine_step(a, s) for s in range(2)]
    a.save(tmp_path / "ckpt", {"val_points": []})
    b = SimEngine(config(**sets, train__device=then))
    step, _ = b.load(tmp_path / "ckpt")
    assert step == 2
    part += [engine_step(b, s) for s in range(2, 4)]
    for s, (x, y) in enumerate(zip(reference, part)):
        assert abs(x - y) < LOSS_TOL, f"step {s}: {x} vs {y}"
    assert b.bytes_total() == whole.bytes_total()
    assert all(p.device.type == then for st in b.mesh.replicas[0] for p in st.parameters())


def test_dist_on_cuda_equals_sim_on_cuda(tmp_path):
    args = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "train.steps=3",
            "--set", "train.batch_size=2", "--set", "train.seq_len=32", "--set", "train.microbatches=2",
            "--set", "train.lr=1e-3", "--set", "train.checkpoint_every=0", "--set", "train.dtype=float32",
            "--set", f"train.device={GPU}", "--set", "mesh.pp=2", "--set", "mesh.dp=2", "--set", "boundary.kind=mask",
            "--set", "dp.kind=powersgd", "--set", "dp.start_step=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sim = subprocess.run([sys.executable, "-m", "thinpipe", "train", "--out", str(tmp_path / "sim"), "--quiet", *args],
                         env=env, capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stderr
    d = subprocess.run([sys.executable, "-m", "thinpipe", "launch", "--nproc", "4", "--", "train", "--engine", "dist",
                        "--out", str(tmp_path / "dist"), "--quiet", *args], env=env, capture_output=True, text=True,
                       timeout=300)
    assert d.returncode == 0, d.stderr[-3000:]
    rows = {k: [json.loads(x) for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
            for k in ("sim", "dist")}
    for a, b in zip(rows["sim"], rows["dist"]):
        assert abs(a["loss"] - b["loss"]) < DIST_TOL
        assert {k: v for k, v in a.items() if k.endswith("_bytes")} == \
            {k: v for k, v in b.items() if k.endswith("_bytes")}


def test_eval_logits_and_generation_on_cuda():
    from thinpipe.data import ByteTokenizer
    from thinpipe.eval.generative import greedy_generate
    from thinpipe.eval.loglik import logits_fn_from_model

    model = tiny_model("llama").eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        cpu = logits_fn_from_model(model)(ids, mask)
        gpu = logits_fn_from_model(model.to(CUDA))(ids, mask)
        text = greedy_generate(model, ByteTokenizer(), "12+3=", ["\n"], max_new_tokens=4)
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-3, atol=1e-4)
    assert isinstance(text, str)
