"""Each rank's peak memory, predicted (issue 51; docs/memory.md, "Predicted per rank").

A rank of a dist job holds one stage (``rank/from_config.py: load_stage``). Its peak is the largest of two moments:

- **training** (from the second step on, when the optimizer's state exists): the stage's fp32 weights, their
  gradients (what trains: every parameter, or LoRA's adapters), the optimizer's state (AdamW: two moments; Muon:
  one momentum for the decoder layers' matrices, AdamW's two for the rest), the DP scheme's own state
  (``DPKind.state_bytes_per_param``: DiLoCo's global copy and outer momentum), and the activations of the
  microbatches the schedule holds in flight at once (``rank/schedule.py``: 1F1B holds min(K - s, M) on stage s,
  GPipe all M), each microbatch's received boundary input, the last stage's head and loss, and the backward's
  transient gradients;
- **the job's end** (``engine/job_model.py``), gradients released: the writer rank (``train.model_rank``) holds the
  whole model's fp32 weights gathered there (the shares assigned into one model) beside its weights and optimizer
  state, and the largest share received in flight; every other stage of replica 0 its share's one copy for the
  wire. This is host memory: on a GPU it is reported apart (``end_host_bytes``), not in the device's peak.

Activations are not a formula of the architecture: they are what autograd keeps, which depends on transformers'
layer code, the attention kernel, LoRA's wrappers and the dtype. So one decoder layer of the planned architecture
(random weights, a 1-layer middle stage built by ``build_stages`` and configured by ``configure_stage`` as a run
configures it: packed attention, LoRA) runs forward and backward on this machine's CPU at two small token counts,
under ``torch.autograd.graph.saved_tensors_hooks`` (every tensor kept for the backward) and a dispatch mode that
sees every block an op allocates. Each is a straight line in the tokens (the attention kernels keep O(T) per head:
no T x T score matrix), extrapolated to the run's microbatch. On a GPU a layer holds what it saved (the caching
allocator reuses every freed block). A CPU process's resident set holds more: glibc's malloc serves blocks under
its mmap threshold (at most 32 MiB) from the heap and keeps them when freed, later blocks reusing only part of
them, so a layer also holds a fraction (``HEAP_RETAINED``, fitted on another model) of the blocks its forward
freed that are under 32 MiB at the run's size. With checkpointing a layer keeps only its input, and one layer's
activations exist at once while it is recomputed.

The runtime floor: a CPU process (torch, transformers, the tokenizer, the packed data) peaks at ~0.45 GiB doing
nothing else (a 1-stage ``tiny-llama`` job, ``benchmarks/results/scale_memory_floor.json``: 441 MiB; the scale
presets' 32k BPE tokenizer adds a little); a GPU's CUDA context and allocator reserve are taken as 0.5 GiB.
What is not modelled (listed in the prediction as ``not_modelled``): the anchor circuit's state on the fast
ranks (the spectral correction's momentum and basis), a boundary kind's learned modules, and the allocator's
fragmentation.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import lru_cache

from thinpipe.config import Config
from thinpipe.dp.kinds import describe
from thinpipe.rank.schedule import SCHEDULES

GIB = 2 ** 30
FLOOR_BYTES = {"cpu": int(0.45 * GIB), "gpu": int(0.5 * GIB)}
MEASURE_TOKENS = (64, 128)  # the two token counts one layer's saved bytes are measured at (a line through them)
MEASURE_DOCUMENTS = 4       # packed documents per measured row: the packed path's gathers are kept too
WEIGHT_BYTES = 4            # fp32 master weights (train.dtype bfloat16 is autocast over fp32 weights)
HEAP_BLOCK_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: a larger block is always mmapped
# The fraction of those freed heap blocks a CPU process still holds at its peak (the rest were reused by later
# blocks): fitted on small-llama (full and LoRA, 2 x 2,048 and 4 x 1,024 tokens: 0.39, 0.40), not on the presets
# the prediction is checked against (benchmarks/memory_prediction.py)
HEAP_RETAINED = 0.4


@dataclass(frozen=True)
class Line:
    """Bytes as a straight line in a microbatch's tokens."""
    per_token: float
    fixed: float

    def at(self, tokens: int) -> float:
        return self.per_token * tokens + self.fixed

    @classmethod
    def through(cls, n1: int, b1: float, n2: int, b2: float) -> "Line":
        slope = (b2 - b1) / (n2 - n1)
        return cls(slope, max(b1 - slope * n1, 0.0))


@dataclass(frozen=True)
class LayerActivations:
    """One decoder layer's memory per microbatch, as ``Line``s in its tokens: what it ``saved`` for its backward
    (live bytes), its ``input`` (all a checkpointed layer keeps), and each block its forward allocates but does not
    keep (``freed``, one line per allocation, in the order the ops ran)."""
    saved: Line
    input: Line
    freed: tuple[Line, ...]
    forward_excess: Line
    """How far above what it ends holding a layer's live blocks rise during its forward (its temporaries at once)."""

    def resident(self, tokens: int, cpu: bool, trimmed: bool = True) -> float:
        """What one layer's forward leaves resident: on a GPU its saved tensors (the caching allocator reuses every
        freed block), and on the CPU too when the heap is trimmed after each layer (``train.cpu_heap_trim``,
        ``models/heap.py``); without the trim also part of each freed block under glibc's largest mmap threshold
        (``HEAP_BLOCK_BYTES``): malloc serves those from the heap, which keeps them after they are freed (reused by
        later blocks only in part), while a larger block is mapped and unmapped."""
        kept = self.saved.at(tokens)
        if cpu and not trimmed:  # a fraction of them (HEAP_RETAINED): later blocks reuse the rest
            kept += HEAP_RETAINED * sum(b for b in (line.at(tokens) for line in self.freed) if b < HEAP_BLOCK_BYTES)
        return kept


def in_flight(schedule: str, stages: int, microbatches: int) -> list[int]:
    """The most microbatches each stage holds activations of at once under ``schedule`` (forwards done whose
    backward is not), from the schedule's own action lists (``rank/schedule.py``)."""
    out = []
    for row in SCHEDULES[schedule](stages, microbatches):
        held = peak = 0
        for kind, _ in row:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        out.append(peak)
    return out


def stage_layers(cfg: Config, layers: int) -> list[int]:
    from thinpipe.models.stages import balanced_split

    return cfg.mesh.fixed_split or balanced_split(layers, cfg.mesh.pp)


def lora_params_per_layer(arch, lora) -> int:
    per_layer = arch.layer_matrices()
    return sum(lora.rank * (per_layer[t][0] + per_layer[t][1]) for t in lora.target_modules) if lora.rank else 0


@lru_cache(maxsize=32)
def _measure(hidden: int, intermediate: int, heads: int, kv_heads: int, lora_rank: int, lora_targets: tuple,
             attention: str, dtype: str) -> LayerActivations:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from transformers import LlamaConfig, LlamaForCausalLM

    from thinpipe.config import load_config
    from thinpipe.models.lora import apply_lora
    from thinpipe.models.stages import build_stages
    from thinpipe.rank.context import positions_and_mask
    from thinpipe.rank.from_config import configure_stage

    cfg = load_config(None, [f"model.attention={attention}", f"train.lora.rank={lora_rank}"])
    if lora_rank:
        cfg.train.lora.target_modules = list(lora_targets)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, num_hidden_layers=3, vocab_size=16,
                         max_position_embeddings=max(MEASURE_TOKENS))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = apply_lora(LlamaForCausalLM(config).eval(), cfg.train.lora, 0)
    stage = configure_stage(build_stages(model, [1, 1, 1], 3)[1], cfg).train()  # a middle stage: one layer, no ends
    del model
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    class Allocations(TorchDispatchMode):
        """Every new block an op returns (not a view or an in-place result of its inputs), in order; ``saved``
        marks those autograd keeps (by the latest block at the address the saved tensor lives at)."""

        def __init__(self):
            super().__init__()
            self.sizes: list[int] = []
            self.saved: set[int] = set()
            self.latest: dict[int, int] = {}
            self.live = self.peak = 0  # bytes of the blocks alive now, and at most (each freed with its tensor)

        def _freed(self, size: int) -> None:
            self.live -= size

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
            for t in tree_leaves(out):
                ptr = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
                if ptr is not None and ptr not in given and ptr not in params:
                    size = t.untyped_storage().nbytes()
                    self.latest[ptr] = len(self.sizes)
                    self.sizes.append(size)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._freed, size)
            return out

    def measure(tokens: int) -> tuple[int, int, list[int], int]:
        saved: dict[int, int] = {}
        blocks = Allocations()

        def keep(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                saved[ptr] = t.untyped_storage().nbytes()
                if ptr in blocks.latest:
                    blocks.saved.add(blocks.latest[ptr])
            return t

        pos, docs = positions_and_mask((torch.arange(tokens) * MEASURE_DOCUMENTS // tokens)[None])
        ctx = type("Ctx", (), {"position_ids": pos, "attn_mask": docs})()
        x = torch.randn(1, tokens, hidden, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), cast, blocks:
            out = stage(x, ctx).float().sum()
        excess = max(blocks.peak - blocks.live, 0)  # the forward's peak over what it ends holding
        out.backward()
        freed = [b for i, b in enumerate(blocks.sizes) if i not in blocks.saved]
        return sum(saved.values()), x.numel() * x.element_size(), freed, excess

    (n1, a), (n2, b) = ((n, measure(n)) for n in MEASURE_TOKENS)
    if len(a[2]) != len(b[2]):  # the ops differ between the two lengths: their sum, as one block, instead
        a, b = (a[0], a[1], [sum(a[2])], a[3]), (b[0], b[1], [sum(b[2])], b[3])
    return LayerActivations(Line.through(n1, a[0], n2, b[0]), Line.through(n1, a[1], n2, b[1]),
                            tuple(Line.through(n1, x, n2, y) for x, y in zip(a[2], b[2])),
                            Line.through(n1, a[3], n2, b[3]))


def layer_activations(cfg: Config, arch) -> LayerActivations:
    """One decoder layer of ``arch`` as ``cfg`` trains it (LoRA, attention, dtype), measured here (module
    docstring)."""
    lora = cfg.train.lora
    return _measure(arch.hidden, arch.intermediate, arch.heads, arch.kv_heads, lora.rank,
                    tuple(lora.target_modules) if lora.rank else (), cfg.model.attention,
                    "bfloat16" if cfg.train.dtype == "bfloat16" else "float32")


def predict(cfg: Config, arch, device: str = "cpu", checkpointing: bool | None = None,
            microbatches: int | None = None) -> dict:
    """Each stage's peak bytes for ``cfg`` on ``arch`` (``plan/planner.py: Architecture``), with its parts, as
    ``thinpipe plan`` prints it (``memory``; ``ranks``: one object per stage). ``device``: ``cpu`` (the fp32 run's
    peak RSS, the process floor included) or a GPU's name (device memory); ``checkpointing`` and ``microbatches``
    override the config's (the advice's what-ifs)."""
    t, m = cfg.train, cfg.mesh
    K = m.pp
    M = microbatches or t.microbatches
    ckpt = t.activation_checkpointing if checkpointing is None else checkpointing
    split = stage_layers(cfg, arch.layers)
    per_layer = sum(r * c for r, c in arch.layer_matrices().values()) + 2 * arch.hidden  # + its two norms
    embed = arch.vocab * arch.hidden
    lora_layer = lora_params_per_layer(arch, t.lora)
    tokens = t.batch_size // M * t.seq_len  # one microbatch's
    flight = in_flight(t.schedule, K, M)
    act, cpu, trimmed = layer_activations(cfg, arch), device == "cpu", t.cpu_heap_trim
    dp_state = describe(cfg.dp.kind).state_bytes_per_param(cfg.dp) if m.dp > 1 else 0
    wire = 2 if (cfg.boundary.dtype if cfg.boundary.dtype != "auto" else t.dtype) == "bfloat16" else 4
    needs_logits = t.objective != "sft" or not t.loss_chunk_tokens or tokens <= t.loss_chunk_tokens
    floor = FLOOR_BYTES["cpu" if device == "cpu" else "gpu"]
    stage_params = []
    for s, n_layers in enumerate(split):
        params = n_layers * per_layer + (embed if s == 0 else 0)
        if s == K - 1:
            params += arch.hidden + (embed if (K > 1 or not arch.tied) else 0)  # final norm; head (a copy if tied)
        stage_params.append(params)
    total_params = sum(stage_params) - (embed if arch.tied and K > 1 else 0)
    ranks = []
    for s, n_layers in enumerate(split):
        params = stage_params[s]
        trained = n_layers * lora_layer if t.lora.rank else params
        decoder_trained = n_layers * (lora_layer if t.lora.rank else per_layer - 2 * arch.hidden)
        optim = (4 * decoder_trained + 8 * (trained - decoder_trained) if t.optimizer == "muon" else 8 * trained)
        weights = WEIGHT_BYTES * params + 4 * (trained if t.lora.rank else 0)  # LoRA: the adapters besides
        grads, dp = 4 * trained, dp_state * trained
        kept = act.input.at(tokens) if ckpt else act.resident(tokens, cpu, trimmed)  # a layer's, per microbatch
        activations = flight[s] * n_layers * kept
        # one layer at a time: its forward's temporaries, or while its backward runs the gradients of what it saved;
        # with checkpointing also its recomputed forward
        transient = max(act.forward_excess.at(tokens), act.saved.at(tokens)) + \
            (act.resident(tokens, cpu, trimmed) if ckpt else 0)
        boundary = flight[s] * tokens * arch.hidden * wire * ((s > 0) + (s < K - 1))  # received input, sent output
        head = 0.0
        if s == K - 1:
            chunk = tokens if needs_logits else t.loss_chunk_tokens
            head = 3 * chunk * arch.vocab * 4  # logits, their log-softmax and its gradient (fp32)
        training = floor + weights + grads + optim + dp + activations + transient + boundary + head
        parts = {"floor": floor, "weights": weights, "gradients": grads, "optimizer": optim, "dp_state": dp,
                 "activations": activations, "transient": transient, "boundary": boundary, "head": head}
        row = {"stage": s, "layers": n_layers, "params": params, "trained_params": trained,
               "microbatches_in_flight": flight[s], "parts_bytes": {k: int(v) for k, v in parts.items()},
               "training_peak_bytes": int(training)}
        peak = training
        # the job's end (engine/job_model.py), gradients released: the writer of OUT/model (global rank s is replica
        # 0's stage s) gathers the whole model and holds the largest share in flight; every other stage of replica 0
        # copies its share once for the wire. On the host: a GPU rank's device memory does not hold it.
        if s == t.model_rank:
            largest_other = max((p for i, p in enumerate(stage_params) if i != s), default=0)
            gathered = WEIGHT_BYTES * (total_params + largest_other)
        else:
            gathered = WEIGHT_BYTES * params
        if cpu:
            end = floor + weights + optim + dp + gathered
            row["end_peak_bytes"] = int(end)
            peak = max(peak, end)
        else:
            row["end_host_bytes"] = int(gathered)
        row["peak_bytes"] = int(peak)
        ranks.append(row)
    out = {"source": "plan/memory.py: parameters x bytes; one decoder layer's activations measured on this CPU "
                     "(saved tensors and allocated blocks) x layers x microbatches in flight",
           "device": device, "tokens_per_microbatch": tokens, "activation_checkpointing": ckpt,
           "layer_bytes": {"saved": act.saved.at(tokens), "resident": act.resident(tokens, cpu, trimmed)},
           "ranks": ranks,
           "largest_peak_bytes": max(r["peak_bytes"] for r in ranks)}
    if checkpointing is None:  # the configured run, and beside it the same run with checkpointing switched
        other = "without" if ckpt else "with"
        out["other_checkpointing"] = other
        for row, alt in zip(ranks, predict(cfg, arch, device, not ckpt, microbatches)["ranks"]):
            row[f"activations_bytes_{other}_checkpointing"] = alt["parts_bytes"]["activations"]
            row[f"peak_bytes_{other}_checkpointing"] = alt["peak_bytes"]
    missing = [why for why, on in (("the anchor circuit's state (spectral momentum and basis)", m.anchor),
                                   ("the boundary's learned modules", cfg.boundary.spec().needs_model)) if on]
    if missing:
        out["not_modelled"] = missing
    return out


# What --memory-gb tries when a rank does not fit, cheapest first: more microbatches cost no compute (fewer tokens
# in flight), checkpointing one more forward per layer, a rebalanced split nothing but moves layers, LoRA changes
# what trains.
def _candidates(cfg: Config, arch) -> list[tuple[str, dict[str, str]]]:
    t, out = cfg.train, []
    more = [mb for mb in range(t.microbatches + 1, t.batch_size + 1) if t.batch_size % mb == 0]
    if more:
        out.append(("more microbatches", {"train.microbatches": str(more[-1])}))
    if not t.activation_checkpointing:
        out.append(("activation checkpointing", {"train.activation_checkpointing": "true"}))
        if more:
            out.append(("activation checkpointing and more microbatches",
                        {"train.activation_checkpointing": "true", "train.microbatches": str(more[-1])}))
    if cfg.mesh.pp > 1:
        out.append(("a split by memory", {"mesh.split": "auto-memory"}))
    if not t.lora.rank:
        out.append(("LoRA (rank 16)", {"train.lora.rank": "16"}))
        if not t.activation_checkpointing:
            out.append(("LoRA (rank 16) and activation checkpointing",
                        {"train.lora.rank": "16", "train.activation_checkpointing": "true"}))
    return out


def _with(cfg: Config, sets: dict[str, str], arch, device: str) -> tuple[Config, dict[str, str]]:
    """``cfg`` with ``sets`` applied (``mesh.split = auto-memory``: the split found here) and the sets as applied."""
    sets = dict(sets)
    if sets.get("mesh.split") == "auto-memory":  # the split whose largest stage peak is least, by moving one layer
        split = stage_layers(cfg, arch.layers)
        best = predict(cfg, arch, device)["largest_peak_bytes"]
        improved = True
        while improved:
            improved = False
            peaks = [r["peak_bytes"] for r in predict(_set(cfg, {"mesh.split": str(split)}), arch, device)["ranks"]]
            hi = max(range(len(split)), key=peaks.__getitem__)
            for lo in sorted(range(len(split)), key=peaks.__getitem__):
                if lo == hi or split[hi] <= 1:
                    continue
                trial = list(split)
                trial[hi] -= 1
                trial[lo] += 1
                peak = predict(_set(cfg, {"mesh.split": str(trial)}), arch, device)["largest_peak_bytes"]
                if peak < best:
                    split, best, improved = trial, peak, True
                    break
        sets["mesh.split"] = str(split)
    return _set(cfg, sets), sets


def _set(cfg: Config, sets: dict[str, str]) -> Config:
    import copy

    from thinpipe.config import apply_overrides

    new = copy.deepcopy(cfg)
    apply_overrides(new, sets, source="thinpipe plan --memory-gb")
    return new.validate()


def fit(cfg: Config, arch, device: str, memory_gb: float) -> dict:
    """Whether every rank's predicted peak fits ``memory_gb`` GiB; if not, the cheapest change that makes them fit
    (``_candidates``' order), as ``--set`` lines, or that none of them does."""
    limit = memory_gb * GIB
    now = predict(cfg, arch, device)
    over = [r["stage"] for r in now["ranks"] if r["peak_bytes"] > limit]
    out = {"memory_gb": memory_gb, "fits": not over, "stages_over": over}
    if not over:
        return out
    for what, sets in _candidates(cfg, arch):
        trial, sets = _with(cfg, sets, arch, device)
        peak = predict(trial, arch, device)["largest_peak_bytes"]
        if peak <= limit:
            out.update({"change": what, "settings": sets, "largest_peak_bytes": peak})
            return out
    out["change"] = None
    return out
