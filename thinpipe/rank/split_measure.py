"""A rank's measurement for ``mesh.split = "auto"`` (``models/auto_split.py``): its speed and memory at the run's
shapes, before it loads its stage.

The model measured is a 3-layer model of the run's config at random (only times and sizes are read): its middle
stage is one decoder layer without ends, its first and last stages add the embedding or the norm, head and loss.
Each is timed forward + backward, the least of a few runs after a warm-up, at one microbatch; a rank slowed by
``THINPIPE_SLOW_RANK`` sleeps as its training compute does (``rank/timing.py``), so it measures itself slower.
"""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from thinpipe.faults import slow_factor
from thinpipe.models.auto_split import Measure, choose_split, stage_measures, summary
from thinpipe.models.families import family_of
from thinpipe.models.lora import apply_lora
from thinpipe.models.stages import build_stages
from thinpipe.placement import local_rank
from thinpipe.rank.context import make_contexts
from thinpipe.rank.from_config import configure_stage, load_empty

MEASURE_REPEATS = 5
MEASURE_BUDGET_S = 0.25  # per measured part: a few runs of a real layer, tens of a tiny one


def _timed(fn, slow: float, budget_s: float = MEASURE_BUDGET_S) -> float:
    """The least seconds of ``fn`` over at least ``MEASURE_REPEATS`` runs (more until ``budget_s`` is spent) after
    two warm-ups: the least, not the mean, since a measurement can only be slowed by what else runs; a slowed
    rank's factor applied (``THINPIPE_SLOW_RANK``: it sleeps as its training compute does, so it measures itself
    slower)."""
    fn()
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < MEASURE_REPEATS or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    took = min(times)
    if slow > 1.0:
        time.sleep(took * (slow - 1.0) * len(times))  # as long as its slowed runs would have taken
    return took * max(slow, 1.0)


def measure(cfg, model_config, stage: int, device, free_bytes: float, slow: float = 1.0) -> Measure:
    """This rank's ``Measure`` at the run's shapes: a 3-layer model of ``model_config`` (the run's family; random
    weights: only times and sizes are read) with the run's LoRA and stage settings, one microbatch
    (``train.batch_size / train.microbatches`` rows of ``train.seq_len``); stage ``stage`` of ``mesh.pp`` (its ends:
    the embedding on the first, norm + head + loss on the last)."""
    t, pp = cfg.train, cfg.mesh.pp
    rows, tokens = max(t.batch_size // t.microbatches, 1), t.seq_len
    in_flight = min(t.microbatches, pp) if t.schedule == "1f1b" else t.microbatches
    adam_bytes = 8
    config = copy.deepcopy(model_config)
    config.num_hidden_layers = 3
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:3])
    family_of(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        small = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=family_of(config).attn_implementation(config))
        small = apply_lora(small.eval(), t.lora, 0)  # inside fork_rng: the run's own draws are untouched
    parts = [configure_stage(st, cfg).to(device) for st in build_stages(small, [1, 1, 1], 3)]
    ids = torch.randint(0, config.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "segment_ids": torch.zeros_like(ids)}
    ctx = make_contexts({k: v.to(device) for k, v in batch.items()}, 1, 0, 0)[0]
    hidden = torch.randn(rows, tokens, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(device)

    def run(st, x) -> None:
        out = st(x, ctx)
        (out if out.dim() == 0 else out.float().square().mean()).backward()
        for p in st.parameters():
            p.grad = None

    def middle() -> None:
        run(parts[1], hidden.clone().requires_grad_(True))

    layer_s = _timed(middle, slow)
    saved = _saved_bytes(lambda: parts[1](hidden.clone().requires_grad_(True), ctx))
    ends_s, ends_bytes = 0.0, 0.0
    trained = [p for p in parts[1].parameters() if p.requires_grad]
    per_param = 4 + 4 + adam_bytes  # fp32 weight, its gradient, Adam's two moments
    layer_bytes = sum(p.numel() for p in parts[1].parameters()) * 4 + sum(p.numel() for p in trained) * (
        per_param - 4) + saved * in_flight
    if stage == 0 or stage == pp - 1:
        end = parts[0] if stage == 0 else parts[2]
        x = ids.to(device) if stage == 0 else hidden
        whole = _timed(lambda: run(end, x if stage == 0 else x.clone().requires_grad_(True)), slow)
        ends_s = max(whole - layer_s, 0.0)
        ends = [p for n, p in end.named_parameters() if not n.startswith("layers.")]
        ends_bytes = sum(p.numel() for p in ends) * per_param
    return Measure(layer_s, ends_s, free_bytes, float(layer_bytes), float(ends_bytes))


def _saved_bytes(forward) -> float:
    """Bytes of the tensors autograd saves in ``forward`` (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return float(sum(seen.values()))


def free_memory_bytes(device: torch.device, ranks_here: int) -> float:
    """Memory this rank may use: the GPU's free memory, or on the CPU the machine's available memory shared by the
    ranks on it (inf where it cannot be read)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024 / max(ranks_here, 1)
    except OSError:
        pass
    return float("inf")


def agree_split(cfg, layout, role, device) -> dict:
    """``mesh.split = "auto"`` on a real mesh: every process measures itself (``measure``; the processes of one
    machine one at a time), the measurements are gathered (float64 tensors over the world's gloo group: no pickle),
    and each process computes the same split from the fast ranks' (``choose_split``), which replaces ``auto`` in
    ``cfg.mesh.split``. Returns ``summary.json``'s ``split_auto``. An anchor rank measures too (the collective needs
    every process) but its row does not vote: the fast circuit sets the pace."""
    model_config = load_empty(cfg).model.config
    here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # The ranks of one machine measure in turn (they share its cores and memory bandwidth: measured at once, each
    # would time the others' load); machines measure at once. Every rank takes every turn's barrier.
    turns = torch.tensor([here], dtype=torch.int64)
    dist.all_reduce(turns, op=dist.ReduceOp.MAX)
    mine = None
    for turn in range(int(turns)):
        if local_rank() == turn:
            mine = measure(cfg, model_config, role.stage, device, free_memory_bytes(device, here),
                           slow_factor(role.rank))
        dist.barrier()
    assert mine is not None, f"local rank {local_rank()} is not below LOCAL_WORLD_SIZE {here}"
    t = torch.tensor(mine.as_list(), dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    measures = {(layout.role(r).replica, layout.role(r).stage): Measure.of_list(v.tolist())
                for r, v in enumerate(out) if layout.role(r).circuit == "fast"}
    split = choose_split(model_config.num_hidden_layers, stage_measures(measures, cfg.mesh.pp))
    cfg.mesh.split = split
    return summary(split, measures, "measured on every fast rank at the run's shapes")


def simulated_split(cfg, model_config, device) -> dict:
    """``mesh.split = "auto"`` in the simulation: one measurement of a layer and of each end in this process, every
    stage's divided by its declared relative speed (``mesh.speeds``; empty: equal), no memory bound (one process
    holds every stage); the same choice real ranks make from the same numbers. Sets ``cfg.mesh.split``."""
    pp = cfg.mesh.pp
    speeds = cfg.mesh.speeds or [1.0] * pp
    first = measure(cfg, model_config, 0, device, float("inf"))
    last = measure(cfg, model_config, pp - 1, device, float("inf")) if pp > 1 else first
    measures = {}
    for s in range(pp):
        end = first.ends_s if s == 0 else last.ends_s if s == pp - 1 else 0.0
        ends_bytes = first.ends_bytes if s == 0 else last.ends_bytes if s == pp - 1 else 0.0
        measures[(0, s)] = Measure(first.layer_s / speeds[s], end / speeds[s], float("inf"), first.layer_bytes,
                                   ends_bytes)
    split = choose_split(model_config.num_hidden_layers, [measures[(0, s)] for s in range(pp)])
    cfg.mesh.split = split
    return summary(split, measures, "simulation: one measurement here, each stage's divided by mesh.speeds")
