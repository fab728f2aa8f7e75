"""``thinpipe plan``: a deployment's speed, bytes per token and anchor staleness, predicted from a
training config, a model architecture and a device profile with the paper's closed form
(``closed_form.py``: App. J.1 step time, App. H anchor cycle) and, for the pipeline, a
schedule-level simulation (``des.py``; the ``des_*`` keys). Every number says where it comes from.

Inputs read from the config: mesh.dp (fast replicas D), mesh.pp (stages K), mesh.anchor;
train.batch_size x train.seq_len (tokens per replica step S), train.dtype (bytes per DP element);
boundary.dtype (the PP wire: ``auto`` is train.dtype, as ``rank/from_config.py: wire_dtype``; it sets
b_act, and Dense's bytes that the PP compression is stated against); the [boundary] section (the
fraction of a dense boundary's bytes sent, which the configured kind's boundaries count, built on the
architecture: a quantiser's codes are the same bytes on either wire, so its fraction doubles on a bf16
one); dp.kind, dp.rank, dp.inner_steps (PowerSGD ratio from the architecture's matrix shapes, DiLoCo's
sync interval); anchor.push_rank; link.pp_mbps and link.dp_mbps (bandwidths; the anchor's pull and push
use the DP link).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from thinpipe.config import BOUNDARY_KINDS, Config, ConfigError
from thinpipe.dp.kinds import describe, lowrank_ratio
from thinpipe.plan import closed_form as cf
from thinpipe.plan.churn import churn_tokens_per_s, heal_bytes
from thinpipe.plan.des import PipelineStep, simulate
from thinpipe.plan.device import DEVICES, Device  # noqa: F401  (DEVICES: re-exported)
from thinpipe.plan.memory import predict as predict_memory


@dataclass(frozen=True)
class Architecture:
    """What the planner needs of a model (decoder-only, Llama-style; a mixture of experts where ``experts`` > 0)."""
    params: float
    layers: int
    hidden: int
    intermediate: int
    """The MLP width one token computes through: a dense model's, or a MoE's active experts' together."""
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    experts: int = 0
    """Routed experts per layer (0: dense). Each is a gate/up/down MLP of ``intermediate / active_experts``."""
    active_experts: int = 0
    """Experts each token is routed to (``num_experts_per_tok``): only they compute."""

    def layer_matrices(self) -> dict[str, tuple[int, int]]:
        """One decoder layer's weight matrices, (rows, cols) by module name (a MoE's experts as one fused matrix per
        projection, as transformers holds them, and its router)."""
        h, kv = self.hidden, self.hidden * self.kv_heads // self.heads
        width = self.intermediate // self.active_experts * self.experts if self.experts else self.intermediate
        out = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
               "gate_proj": (width, h), "up_proj": (width, h), "down_proj": (h, width)}
        if self.experts:
            out["router"] = (self.experts, h)
        return out

    @property
    def active_params(self) -> float:
        """Parameters one token computes with: all of a dense model's; a MoE's without its idle experts (the compute
        the closed form counts, 6 x active parameters x tokens)."""
        if not self.experts:
            return self.params
        idle = 3 * self.hidden * self.intermediate // self.active_experts * (self.experts - self.active_experts)
        return self.params - self.layers * idle

    def matrices(self) -> list[tuple[int, int]]:
        """Every weight matrix's (rows, cols): per layer q, k, v, o, gate, up, down; the embeddings."""
        emb = [(self.vocab, self.hidden)] * (1 if self.tied else 2)
        return list(self.layer_matrices().values()) * self.layers + emb

    def trained_matrices(self, lora) -> list[tuple[int, int]]:
        """What trains (and so what DP and the anchor exchange): every matrix, or with LoRA
        (``train.lora``) each target module's A (r x cols) and B (rows x r) per layer."""
        if not lora.rank:
            return self.matrices()
        per_layer = self.layer_matrices()
        unknown = [t for t in lora.target_modules if t not in per_layer]
        if unknown:
            raise ConfigError(f"train.lora.target_modules {unknown} are not Llama decoder modules "
                              f"({', '.join(per_layer)})")
        return [shape for t in lora.target_modules
                for shape in ((lora.rank, per_layer[t][1]), (per_layer[t][0], lora.rank))] * self.layers


# Published configs (Hugging Face config.json) and our presets.
ARCHITECTURES = {
    "llama-3.2-1b": Architecture(1.236e9, 16, 2048, 8192, 32, 8, 128256, True),
    "smollm2-135m": Architecture(134.5e6, 30, 576, 1536, 9, 3, 49152, True),
    "small-llama": Architecture(1_706_112, 8, 128, 384, 4, 2, 512, False),
    "tiny-llama": Architecture(213_568, 4, 64, 128, 4, 2, 512, False),
    # the MAPL paper's scales (models/presets.py: SCALES; vocabulary 32,000, untied, multi-head attention)
    "llama-150m": Architecture(177_622_016, 9, 1024, 2688, 8, 8, 32000, False),
    "llama-500m": Architecture(607_968_768, 18, 1536, 4096, 12, 12, 32000, False),
    "llama-1b": Architecture(1_135_167_488, 20, 2048, 5440, 16, 16, 32000, False),
    # a mixture of experts (OLMoE-1B-7B's config.json: 64 experts of width 1024, 8 per token): 6.92e9 parameters,
    # 1.28e9 active
    "olmoe-1b-7b": Architecture(6_919_161_856, 16, 2048, 8 * 1024, 16, 16, 50304, False, experts=64,
                                active_experts=8),
}


PRESETS = {
    # The anchor-priors paper's setting (§5.1, App. H.2, App. J): Llama-3.2-1B, 8 stages, 7 fast
    # replicas + 1 anchor replica, 16 microbatches of 2048 tokens, bf16, 200 Mbit/s links,
    # PowerSGD ~64x with DiLoCo H = 10, A100-40GB.
    "paper-llama1b": {"model.name": "llama-3.2-1b", "mesh.pp": "8", "mesh.dp": "7", "mesh.anchor": "0",
                      "train.batch_size": "16", "train.microbatches": "16", "train.seq_len": "2048",
                      "train.dtype": "bfloat16", "link.pp_mbps": "200", "link.dp_mbps": "200",
                      "dp.kind": "diloco", "dp.rank": "26", "dp.inner_steps": "10", "anchor.push_rank": "26"},
}
PRESET_DEVICE = {"paper-llama1b": "a100-40gb"}


def powersgd_ratio(arch: Architecture, rank: int, lora=None) -> float:
    """Bytes sent / dense bytes for PowerSGD at ``rank`` over the trained matrices (vectors,
    ~0.1% of a Llama, are left out); a matrix PowerSGD cannot shrink is sent dense."""
    return lowrank_ratio(arch.trained_matrices(lora) if lora is not None else arch.matrices(), rank)


def wire_dtype_name(cfg: Config) -> str:
    """The dtype PP activations and gradients cross in: ``boundary.dtype``, or with ``auto`` the
    training dtype (``rank/from_config.py: wire_dtype``); an unresolved ``train.dtype = auto`` is fp32
    (the CPU's; ``commands/plan.py`` resolves it for the plan's device first)."""
    name = cfg.boundary.dtype if cfg.boundary.dtype != "auto" else cfg.train.dtype
    return "bfloat16" if name == "bfloat16" else "float32"


def wire_bytes(cfg: Config) -> int:
    """b_act: bytes of one value on the PP wire."""
    return 2 if wire_dtype_name(cfg) == "bfloat16" else 4


PLANNED_TOKENS = 1 << 30  # a long run's tokens: the per-token figure without a microbatch's rounding


def activation_fraction(cfg: Config, arch: Architecture, elem_bytes: int) -> float:
    """rho_act: the fraction of a dense boundary's bytes (forward + backward) a step sends, averaged over the
    pipeline's boundaries (``activation_fractions``; the closed form's one rho_act for them all)."""
    per = activation_fractions(cfg, arch, elem_bytes)
    return sum(f + b for f, b in per) / len(per)


def activation_fractions(cfg: Config, arch: Architecture, elem_bytes: int) -> list[tuple[float, float]]:
    """Per boundary, the (forward, backward) fractions of a dense boundary's bytes (forward + backward) a step sends:
    what its kind (``boundary.kinds[b]`` or ``boundary.kind``), built on ``arch`` without weights, counts
    (``Boundary.planned_bytes``: the kind's own formula). A kind that cannot be built without the model's weights
    (its ``needs_model``) is refused in one line."""
    from thinpipe.boundary import build_boundaries  # torch: only when a boundary is planned (plan/device.py)

    stages = max(cfg.mesh.pp, 2)
    for b in range(stages - 1):
        spec = cfg.boundary.spec(cfg.boundary.kind_at(b) if cfg.boundary.kinds else None)
        if spec.needs_model:
            able = ", ".join(name for name, kind in BOUNDARY_KINDS.items() if not kind.needs_model)
            raise ConfigError(f"thinpipe plan models boundary.kind = {able}, not {spec.name!r}: "
                              f"{spec.needs_model}; `thinpipe probe` measures its bytes")
    every = replace(cfg.boundary, masked=[])
    boundaries = build_boundaries(every, stages, arch.hidden, 0, None)
    dense = 2 * PLANNED_TOKENS * arch.hidden * elem_bytes
    return [(f / dense, bw / dense) for f, bw in (b.planned_bytes(PLANNED_TOKENS, elem_bytes) for b in boundaries)]


def plan(cfg: Config, device: Device, rho_act: float | None = None, replica_mtbf_h: float | None = None,
         restart_s: float = 60.0, memory_device: str | None = None) -> dict:
    """The closed form and schedule simulation of ``cfg`` on ``device``. ``rho_act``: the boundary's
    measured fraction of dense bytes (``thinpipe probe``) for a kind the closed form does not model.
    ``replica_mtbf_h``: with elastic replicas failing this often each (and ``restart_s`` to start
    one again), the expected tokens/s with churn (``plan/churn.py``). ``memory_device``: the device's name, to
    predict each rank's peak memory on it (``plan/memory.py``; ``memory`` in the result)."""
    m, t, d, link = cfg.mesh, cfg.train, cfg.dp, cfg.link
    arch = ARCHITECTURES.get(cfg.model.name)
    if arch is None:
        raise ConfigError(f"thinpipe plan knows no architecture {cfg.model.name!r}: choose one of "
                          f"{', '.join(sorted(ARCHITECTURES))}")
    if m.pp > arch.layers:
        raise ConfigError(f"mesh.pp = {m.pp} stages but {cfg.model.name} has {arch.layers} layers")
    if link.pp_mbps_min <= 0 or (link.dp_mbps <= 0 and (m.dp > 1 or m.anchor)):
        raise ConfigError("thinpipe plan needs link bandwidths: set link.pp_mbps (and link.dp_mbps with several "
                          "replicas or an anchor) in Mbit/s")
    K, D, N, H = m.pp, m.dp, arch.params, arch.hidden
    # DP syncs and the anchor's pull / push carry what trains: all N, or LoRA's adapters
    N_train = sum(r * c for r, c in arch.trained_matrices(t.lora)) if t.lora.rank else N
    S = t.batch_size * t.seq_len
    b = 2 if t.dtype == "bfloat16" else 4  # DP: the training dtype (the paper's b_grad)
    # PP and the anchor's pull / push (anchor/codec.py casts them to it): the wire dtype, which
    # boundary.dtype may set apart from train.dtype
    b_act = wire_bytes(cfg)
    B_pp, B_dp = link.pp_mbps_min * 1e6 / 8, (link.dp_mbps or link.pp_mbps_min) * 1e6 / 8
    # per boundary: its link's bandwidth and its kind's fractions (forward, backward); one of each everywhere unless
    # link.pp_mbps or boundary.kinds lists them
    rates = [link.pp_mbps_at(b) * 1e6 / 8 for b in range(max(K - 1, 1))]
    per = (activation_fractions(cfg, arch, b_act) if rho_act is None else [(rho_act / 2, rho_act / 2)] * len(rates))
    rho_act = sum(f + bw for f, bw in per) / len(per)
    # the DP scheme describes its own exchange (dp/kinds.py): bytes over dense, steps per exchange
    scheme = describe(d.kind)
    rho_dp, tau = scheme.wire_ratio(d, arch.trained_matrices(t.lora)), scheme.sync_interval(d)
    t_compute = cf.t_compute_s(arch.active_params, S, K, device.peak_flops, device.mfu)  # a MoE: active experts
    # App. J.1's T_PP, each boundary's bytes over its own link (equal to 2 (K-1) S H b rho / B when they are alike)
    t_pp = sum(cf.t_pp_s(2, S, H, b_act, f + bw, r) for (f, bw), r in zip(per, rates)) if K > 1 else 0.0
    t_dp = cf.t_dp_s(D, N_train, b, rho_dp, tau, B_dp)
    serial = cf.step_time_s(t_compute, t_pp, t_dp, overlapped=False)
    overlapped = cf.step_time_s(t_compute, t_pp, t_dp, overlapped=True)
    tokens = D * S
    M = t.microbatches
    dense_pp = 2 * (K - 1) * H * b_act  # Dense's bytes per token on this wire, forward + backward

    def pipeline(share: float) -> dict:
        """The schedule with every link's rate divided by ``share`` (1: alone; D: shared by D replicas)."""
        return simulate(PipelineStep(K, M, t_compute / M / 3, 2 * t_compute / M / 3, S / M * H * b_act * rho_act,
                                     S / M * H * b_act * rho_act, B_pp / share,
                                     link.pp_latency_ms_at(0) / 1e3, t.schedule,
                                     rates=tuple(r / share for r in rates),
                                     fwd_bytes_per=tuple(S / M * H * b_act * 2 * f for f, _ in per),
                                     bwd_bytes_per=tuple(S / M * H * b_act * 2 * bw for _, bw in per),
                                     latencies_s=tuple(link.pp_latency_ms_at(b) / 1e3 for b in range(len(rates)))))

    pipe = pipeline(1)
    # One NIC per stage position carrying all D replicas' traffic for that boundary: D flows in
    # lockstep share it fairly (as TCP flows do), so each replica's transfers see B / D.
    shared = pipeline(D)
    out = {
        "source": "closed form (anchor-priors App. J.1; anchor cycle App. H.1-H.4)",
        "device_source": device.source, "device_flops": device.peak_flops * device.mfu,
        "model": cfg.model.name, "params": N, "active_params": arch.active_params, "trained_params": N_train,
        "stages": K, "fast_replicas": D,
        "tokens_per_replica_step": S,
        "rho_act": rho_act, "rho_dp": rho_dp, "tau": tau,
        "t_compute_s": t_compute, "t_pp_s": t_pp, "t_dp_s": t_dp,
        "step_time_s": serial, "step_time_overlapped_s": overlapped,
        "tokens_per_s": tokens / serial, "tokens_per_s_overlapped": tokens / overlapped,
        "des_source": "schedule simulation (plan/des.py): a link per boundary and direction, the schedule's bubble",
        "des_pipeline_s": pipe["makespan_s"], "des_bubble_fraction": 1 - pipe["busy_fraction"],
        "des_step_time_s": pipe["makespan_s"] + t_dp, "des_tokens_per_s": tokens / (pipe["makespan_s"] + t_dp),
        "des_tokens_per_s_overlapped": tokens / max(pipe["makespan_s"], t_dp),
        "des_shared_source": "schedule simulation with every PP link shared fairly by the D replicas of its stages",
        "des_shared_pipeline_s": shared["makespan_s"],
        "des_shared_tokens_per_s": tokens / (shared["makespan_s"] + t_dp),
        # the PP compression is stated against Dense on this plan's own wire: a quantiser's
        # ratio against an fp32 Dense is twice its ratio against the bf16 Dense a GPU sends
        "pp_wire_dtype": wire_dtype_name(cfg), "dense_pp_bytes_per_token": dense_pp,
        "pp_compression_x": 1 / rho_act if K > 1 and rho_act > 0 else None,
        "bytes_per_token": {"pp": dense_pp * rho_act,
                            "dp": (2 * (D - 1) / D * N_train * b * rho_dp / tau / S) if D > 1 else 0.0},
    }
    if m.anchor:
        t_clean = cf.t_pp_s(K, S, H, b_act, 1.0, B_pp) + t_compute
        push_ratio = powersgd_ratio(arch, cfg.anchor.push_rank, t.lora) if cfg.anchor.push_rank else 1.0
        t_pull = cf.t_pull_s(N_train, K, b_act, B_dp)
        t_push = cf.t_push_s(N_train / K * b_act * push_ratio, B_dp)
        out.update({"t_pull_s": t_pull, "t_clean_s": t_clean, "t_push_s": t_push, "t_mask_s": serial,
                    "k_stale": cf.k_stale(t_pull, t_clean, t_push, serial),
                    "k_stale_overlapped": cf.k_stale(t_pull, t_clean, t_push, serial, overlap=True)})
        every = cfg.anchor.every or cfg.anchor.staleness
        # per cycle: the pull (N b), the push to every fast replica, the anchor's dense PP pass
        out["bytes_per_token"]["anchor"] = (N_train * b_act + N_train * b_act * push_ratio * D
                                            + dense_pp * S) / (every * tokens)
    if replica_mtbf_h is not None:
        heal_s = heal_bytes(N, N_train, K, b, scheme.state_bytes_per_param(d)) / B_dp
        out["churn"] = {"replica_mtbf_h": replica_mtbf_h, "restart_s": restart_s, "heal_s": heal_s,
                        **churn_tokens_per_s(tokens / serial, serial, D, replica_mtbf_h * 3600,
                                             cfg.elastic.heartbeat_timeout_s, restart_s, heal_s)}
    if memory_device is not None:
        out["memory"] = predict_memory(cfg, arch, memory_device)
    total = sum(out["bytes_per_token"].values())
    out["bytes_per_token_total"] = total
    # The paper's "Comm. (B/tok)" (Table 1) is this total spread over the K stages (one GPU's links).
    out["bytes_per_token_per_stage"] = total / K
    return out
