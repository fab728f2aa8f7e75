"""``thinpipe plan --target-tps X`` / ``--max-mbps B``: the least compression that meets a target.

Searches the three knobs the anchor-priors paper turns (§5, App. H, J): the activation mask ratio
p, the PowerSGD rank of the DP exchange and DiLoCo's H, on the user's mesh, model, links and device,
inside the paper's stability limits:

- p <= 0.95 (§5.2: 99% masking diverges or degrades sharply);
- PowerSGD at most 64x (the paper's setting; higher ratios were not shown to train);
- DiLoCo H <= 500 (DiLoCo's own range: Douillard et al. 2023, DiLoCo, H = 500 for pretraining);
- with the anchor circuit, K_stale <= 25 fast steps (App. H.3: priors older than ~20-25 steps no
  longer help). Compressing more makes fast steps shorter and so the anchor's priors *staler*:
  this limit can make a target unreachable even where bandwidth alone would allow it.

"Least compression" is ordered: first the smallest p, then the smallest DP compression (PowerSGD
ratio x H). Masking goes last because it is what costs held-out loss in our measurements
(experiments/anchor_priors/README.md: every masked arm ends above Dense), while DP compression with
DiLoCo costs little at H = 10.

Quality (docs/probe.md, "Advice within a quality bound"): without a probe the advice says that it
has not checked what its setting does to the model. With ``--probe probe.json`` (``thinpipe probe``,
same model and stages) the boundary options are the probe's arms whose forward damage (held-out loss
through the compressed boundaries, no training) is within ``--max-damage`` (a fraction of the dense
loss, default 1%); among the settings that meet the target, the least damaged wins (then the least
DP compression). When none meets both, the answer names the closest on each side: the fastest
setting within the damage bound, and the least damaged setting that reaches the target. Bytes: the
closed form's own formula for the kinds it models (tested equal to the probe's meter), the probe's
measured fraction for the others.

The target is met on the closed form's serialised tokens/s (App. J.1: the conservative number, and
the one that fits the paper's Table 1 best, docs/plan.md); ``--max-mbps B`` sets every link to B
Mbit/s and, without ``--target-tps``, asks for the least compression at which the links keep up
with compute when communication overlaps it (App. J.1's overlapped form): max(T_PP, T_DP) <= T_compute.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from thinpipe.config import Config, ConfigError, apply_overrides
from thinpipe.config.boundary_kinds import IdentityKind, MaskKind  # the advice's sweep: the mask ratio
from thinpipe.dp.kinds import DPOption, kinds
from thinpipe.plan.planner import ARCHITECTURES, Device, activation_fraction, plan, powersgd_ratio, wire_bytes

MAX_P = 0.95
MAX_POWERSGD_X = 64.0
MAX_H = 500
MAX_STALENESS = 25.0
P_GRID = (0.0, 0.5, 0.75, 0.8, 0.9, 0.95)
RANK_GRID = (256, 128, 64, 32, 16, 8, 4, 2, 1)
H_GRID = (1, 10, 20, 50, 100, 200, 500)


@dataclass(frozen=True)
class BoundaryOption:
    """One boundary setting the advice may recommend."""

    arm: str
    settings: dict = field(hash=False)   # boundary.* overrides
    order: float                         # sort key: the mask ratio p, or with a probe its forward damage
    damage: float | None = None          # the probe's relative held-out loss increase (None: not checked)
    rho_act: float | None = None         # the probe's measured fraction of dense bytes (kinds the closed form lacks)


def mask_options() -> list[BoundaryOption]:
    return [BoundaryOption("dense" if p == 0 else f"mask p={p:g}",
                           {"boundary.kind": IdentityKind.name} if p == 0 else
                           {"boundary.kind": MaskKind.name, "boundary.p": p}, p)
            for p in P_GRID]


def load_probe(path: str | Path, cfg: Config, max_damage: float) -> list[BoundaryOption]:
    """The arms of a ``thinpipe probe`` result within ``max_damage``, for this model and mesh."""
    if not 0 <= max_damage:
        raise ConfigError(f"--max-damage must be >= 0 (a fraction of the dense held-out loss), got {max_damage}")
    try:
        probe = json.loads(Path(path).read_text())
        arms, model, pp = probe["arms"], probe["model"], probe["pp"]
        rows = [(a["arm"], dict(a["settings"]), float(a["damage_rel"]), float(a["pp_fraction"])) for a in arms]
    except FileNotFoundError:
        raise ConfigError(f"--probe {path}: no such file; write one with `thinpipe probe --out DIR`") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise ConfigError(f"--probe {path} is not a thinpipe probe result ({type(e).__name__}: {str(e)[:200]}); "
                          "write one with `thinpipe probe --out DIR`") from None
    if model != cfg.model.name or pp != cfg.mesh.pp:
        raise ConfigError(f"--probe {path} probed {model} with {pp} stages, the plan is for {cfg.model.name} with "
                          f"{cfg.mesh.pp}: probe this model and mesh (thinpipe probe --model {cfg.model.name} --set "
                          f"mesh.pp={cfg.mesh.pp})")
    arch = ARCHITECTURES[cfg.model.name]
    out = []
    for arm, settings, damage, fraction in rows:
        if damage > max_damage:
            continue
        c = copy.deepcopy(cfg)
        apply_overrides(c, settings, source=f"--probe arm {arm!r}")
        try:
            activation_fraction(c, arch, 4)
            rho = None  # the closed form models this kind's bytes at the plan's dtype
        except ConfigError:
            rho = fraction  # values in the wire dtype (MAPL, SSN): the measured fraction holds at any dtype
        out.append(BoundaryOption(arm, settings, damage, damage, rho))
    return out


@dataclass(frozen=True)
class Candidate:
    boundary: BoundaryOption
    dp: DPOption
    result: dict

    @property
    def p(self) -> float:
        """The advice's boundary order key (the mask ratio without a probe)."""
        return self.boundary.order

    @property
    def h(self) -> int:
        return self.dp.interval

    @property
    def powersgd_x(self) -> float:
        return self.dp.ratio_x

    @property
    def dp_compression_x(self) -> float:
        return self.powersgd_x * self.h

    def settings(self) -> dict[str, str]:
        s = {k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in self.boundary.settings.items()}
        return {**s, **self.dp.settings()}


def _dp_options(cfg: Config) -> list[DPOption]:
    """What every DP scheme offers on the grid of ranks (PowerSGD ratio x within the limit) and H; one replica
    needs no compression: the offers at rank 0 and H = 1."""
    if cfg.mesh.dp <= 1:
        ranks, intervals = [(0, 1.0)], [1]
    else:
        arch = ARCHITECTURES[cfg.model.name]
        ranks = [(0, 1.0)] + [(r, 1 / powersgd_ratio(arch, r, cfg.train.lora)) for r in RANK_GRID]
        ranks = [(r, x) for r, x in ranks if x <= MAX_POWERSGD_X]
        intervals = [h for h in H_GRID if h <= MAX_H]
    return [o for scheme in kinds().values() for o in scheme.offers(ranks, intervals)]


def candidates(cfg: Config, device: Device, options: list[BoundaryOption] | None = None) -> list[Candidate]:
    """Every setting on the grid (boundary ``options``, default the mask ratios), planned, in the
    advice's order: least boundary order key first, then least DP compression."""
    out = []
    for opt in options if options is not None else mask_options():
        for dp in _dp_options(cfg):
            c = copy.deepcopy(cfg)
            apply_overrides(c, {**opt.settings, **dp.overrides()}, source="plan advice")
            out.append(Candidate(opt, dp, plan(c, device, opt.rho_act)))
    out.sort(key=lambda c: (c.p, c.dp_compression_x))
    return out


def advise(cfg: Config, device: Device, target_tps: float | None = None, max_mbps: float | None = None,
           probe: str | Path | None = None, max_damage: float = 0.01) -> dict:
    """The least-compressed (with a probe: least damaged) setting that meets the target, or why none does."""
    if target_tps is None and max_mbps is None:
        raise ConfigError("advice needs --target-tps (tokens/s) and/or --max-mbps (Mbit/s per link)")
    if target_tps is not None and target_tps <= 0:
        raise ConfigError(f"--target-tps must be > 0 tokens/s, got {target_tps}")
    cfg = copy.deepcopy(cfg)
    if max_mbps is not None:
        if max_mbps <= 0:
            raise ConfigError(f"--max-mbps must be > 0 Mbit/s, got {max_mbps}")
        apply_overrides(cfg, {"link.pp_mbps": max_mbps, "link.dp_mbps": max_mbps}, source="--max-mbps")
    if target_tps is not None:
        goal = f"tokens/s >= {target_tps:g} (closed form, serialised)"

        def meets(r: dict) -> bool:
            return r["tokens_per_s"] >= target_tps
    else:
        goal = f"links keep up with compute at {max_mbps:g} Mbit/s (overlapped: max(T_PP, T_DP) <= T_compute)"

        def meets(r: dict) -> bool:
            return max(r["t_pp_s"], r["t_dp_s"]) <= r["t_compute_s"]

    def stable(r: dict) -> bool:
        return r.get("k_stale", 0.0) <= MAX_STALENESS

    # every arm: the bound is applied below
    options = load_probe(probe, cfg, float("inf")) if probe is not None else None
    out = {"goal": goal, "limits": {"p_max": MAX_P, "powersgd_max_x": MAX_POWERSGD_X, "h_max": MAX_H,
                                    "k_stale_max": MAX_STALENESS if cfg.mesh.anchor else None},
           "quality": (f"checked: forward damage <= {max_damage:.1%} of the dense held-out loss (thinpipe probe "
                       f"{probe}, before training)" if probe is not None else
                       "not checked: this advice knows bytes and time, not what the setting does to the model; "
                       "run `thinpipe probe --out DIR` and pass --probe DIR/probe.json")}
    if options is not None and max_damage < 0:
        raise ConfigError(f"--max-damage must be >= 0 (a fraction of the dense held-out loss), got {max_damage}")
    if isinstance(cfg.link.pp_mbps, list) and target_tps is not None and cfg.mesh.pp > 1:
        within = None if options is None else [o for o in options if o.damage is not None and o.damage <= max_damage]
        return _advise_per_boundary(cfg, device, target_tps, within, stable, out)
    if options is not None:
        return _advise_with_quality(cfg, device, options, meets, stable, out, max_damage)
    cands = candidates(cfg, device)
    fast_enough = [c for c in cands if meets(c.result)]
    ok = [c for c in fast_enough if stable(c.result)]
    out["searched"] = len(cands)
    if ok:
        best = ok[0]
        out.update(feasible=True, settings=best.settings(), plan=_summary(best))
        return out
    # Nothing meets the goal: say what limits it.
    fastest = max(cands, key=lambda c: c.result["tokens_per_s"])
    out.update(feasible=False, fastest=_summary(fastest), fastest_settings=fastest.settings())
    if fast_enough:
        least_stale = min(fast_enough, key=lambda c: c.result.get("k_stale", 0.0))
        out["why"] = (f"settings fast enough exist, but their anchor priors are too stale: the least is "
                      f"K_stale = {least_stale.result['k_stale']:.1f} steps > {MAX_STALENESS:g} "
                      f"({_describe(least_stale)}); give the anchor more bandwidth or run it without the target")
    else:
        r = fastest.result
        bound = max(("compute", r["t_compute_s"]), ("PP", r["t_pp_s"]), ("DP", r["t_dp_s"]), key=lambda kv: kv[1])
        out["why"] = (f"no setting within the limits reaches it: the fastest ({_describe(fastest)}) gives "
                      f"{r['tokens_per_s']:.0f} tokens/s, bound by {bound[0]} ({bound[1]:.2f} s of a "
                      f"{r['step_time_s']:.2f} s step); add replicas, bandwidth or faster devices")
    return out


def _advise_with_quality(cfg, device, options, meets, stable, out: dict, max_damage: float) -> dict:
    """The probe's side of ``advise``: ``options`` are every probed arm; the bound picks among them."""
    cands = candidates(cfg, device, options)
    out["searched"] = len(cands)
    fast = [c for c in cands if meets(c.result) and stable(c.result)]
    good = {o.arm for o in options if o.damage <= max_damage}
    both = [c for c in fast if c.boundary.arm in good]
    if both:
        best = min(both, key=lambda c: (c.boundary.damage, c.dp_compression_x))
        out.update(feasible=True, settings=best.settings(), plan=_summary(best), damage=best.boundary.damage)
        return out
    out["feasible"] = False
    within = [c for c in cands if c.boundary.arm in good and stable(c.result)]
    parts = [f"no probed setting both meets the goal and keeps the forward damage <= {max_damage:.1%}"]
    if within:
        c = max(within, key=lambda c: c.result["tokens_per_s"])
        out["closest_within_damage"] = {"settings": c.settings(), "plan": _summary(c), "damage": c.boundary.damage}
        parts.append(f"within the bound the fastest ({_describe(c)}) gives {c.result['tokens_per_s']:.0f} tokens/s")
    else:
        parts.append("no probed arm is within the bound")
    if fast:
        c = min(fast, key=lambda c: (c.boundary.damage, c.dp_compression_x))
        out["closest_at_target"] = {"settings": c.settings(), "plan": _summary(c), "damage": c.boundary.damage}
        parts.append(f"reaching the goal, the least damage is {c.boundary.damage:+.1%} ({_describe(c)})")
    else:
        parts.append("no probed setting reaches the goal")
    out["why"] = "; ".join(parts)
    return out


def _option_fraction(cfg: Config, opt: BoundaryOption) -> float:
    """The fraction of a dense boundary's bytes ``opt`` sends (its kind's own formula, or the probe's measure)."""
    if opt.rho_act is not None:
        return opt.rho_act
    c = copy.deepcopy(cfg)
    apply_overrides(c, {**opt.settings, "boundary.kinds": []}, source=f"plan advice ({opt.arm})")
    return activation_fraction(c, ARCHITECTURES[cfg.model.name], wire_bytes(c))


def _advise_per_boundary(cfg: Config, device: Device, target_tps: float, options: list[BoundaryOption] | None,
                         stable, out: dict) -> dict:
    """Uneven links (``link.pp_mbps`` a list): a codec per boundary (issue 54). For the least DP compression whose
    compute and DP exchange leave time in the step the target allows, that time is shared equally by the boundaries
    (App. J.1's serialised T_PP is their sum), and each boundary takes the least compressed option (with a probe: the
    least damaged within the bound) whose bytes cross its own link in its share. The mask ratio is per boundary
    (``boundary.p`` as a list); two boundaries of one kind otherwise share the kind's table, and the more compressed
    one's hold for both (still within each share). The combined setting is planned again and must meet the target; it
    is printed as a config for ``thinpipe train --config``."""
    options = options if options is not None else mask_options()
    options = sorted(options, key=lambda o: o.order)
    K, D = cfg.mesh.pp, cfg.mesh.dp
    S = cfg.train.batch_size * cfg.train.seq_len
    H = ARCHITECTURES[cfg.model.name].hidden
    fractions = {o.arm: _option_fraction(cfg, o) for o in options}
    searched, last = 0, None
    for dp in sorted(_dp_options(cfg), key=lambda o: o.ratio_x * o.interval):
        base = copy.deepcopy(cfg)
        apply_overrides(base, {**dp.overrides(), "boundary.kind": IdentityKind.name, "boundary.kinds": []},
                        source="plan advice")
        r0 = plan(base, device)
        budget = D * S / target_tps - r0["t_compute_s"] - r0["t_dp_s"]
        searched += 1
        if budget <= 0:
            continue
        share = budget / (K - 1)
        chosen: list[BoundaryOption] = []
        for b in range(K - 1):
            rate = cfg.link.pp_mbps_at(b) * 1e6 / 8
            fits = [o for o in options if 2 * S * H * wire_bytes(cfg) * fractions[o.arm] / rate <= share]
            if not fits:
                break
            chosen.append(fits[0])
        if len(chosen) < K - 1:
            continue
        sets: dict = {**dp.overrides(), "boundary.kind": IdentityKind.name}
        for o in sorted(chosen, key=lambda o: o.order):  # the more compressed option's shared settings win
            sets.update({k: v for k, v in o.settings.items() if k not in ("boundary.kind", "boundary.p")})
        sets["boundary.kinds"] = [o.settings.get("boundary.kind", IdentityKind.name) for o in chosen]
        if any("boundary.p" in o.settings for o in chosen):  # the ratio is per boundary
            sets["boundary.p"] = [float(o.settings.get("boundary.p", 0.0)) for o in chosen]
        c = copy.deepcopy(cfg)
        apply_overrides(c, sets, source="plan advice")
        r = plan(c, device)
        last = (chosen, sets, r)
        if r["tokens_per_s"] >= target_tps and stable(r):
            out.update(feasible=True, searched=searched, plan=r,
                       per_boundary=[{"boundary": b, "link_mbps": cfg.link.pp_mbps_at(b), "arm": o.arm,
                                      **({"damage": o.damage} if o.damage is not None else {})}
                                     for b, o in enumerate(chosen)],
                       settings={k: _value(v) for k, v in sets.items()}, config_toml=_toml(c, sets))
            return out
    out.update(feasible=False, searched=searched)
    if last is None:
        out["why"] = ("no DP setting leaves time for the pipeline at this target: the compute and the DP exchange "
                      "alone take the step it allows; add replicas or faster devices")
    else:
        chosen, sets, r = last
        out["why"] = (f"the per-link choice ({', '.join(o.arm for o in chosen)}) gives {r['tokens_per_s']:.0f} "
                      "tokens/s: add bandwidth to the slowest links")
    return out


def _value(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(str(x) for x in v) + "]"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _toml(cfg: Config, sets: dict) -> str:
    """The advice as a TOML config for ``thinpipe train --config``: the sections it sets, and the links it was for."""
    import tomli_w

    tree: dict = {}
    for key, value in {**sets, "link.pp_mbps": cfg.link.pp_mbps, "mesh.pp": cfg.mesh.pp}.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tomli_w.dumps(tree)


def _describe(c: Candidate) -> str:
    return ", ".join(f"{k}={v}" for k, v in c.settings().items())


def _summary(c: Candidate) -> dict:
    r = c.result
    keys = ("tokens_per_s", "tokens_per_s_overlapped", "step_time_s", "t_compute_s", "t_pp_s", "t_dp_s",
            "bytes_per_token_total", "pp_wire_dtype", "dense_pp_bytes_per_token", "pp_compression_x", "k_stale")
    return {**{k: r[k] for k in keys if k in r}, "powersgd_x": c.powersgd_x, "dp_compression_x": c.dp_compression_x}
