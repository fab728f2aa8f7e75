"""What ``thinpipe plan`` prints: the plan of one setting, and the advice of ``--target-tps`` /
``--max-mbps`` (``advice.py``), as a table or JSON."""

from __future__ import annotations

import json

SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def compression_text(r: dict) -> str:
    """The PP compression of a plan, naming the Dense it is against: Dense on the plan's own wire
    (a quantiser's ratio against an fp32 Dense is twice what a bf16 user gets)."""
    if r.get("pp_compression_x") is None:
        return "- (one stage: no PP boundary)"
    return (f"{r['pp_compression_x']:.1f}x (against Dense on this plan's {SHORT[r['pp_wire_dtype']]} wire: "
            f"{r['dense_pp_bytes_per_token']:,.0f} B/token)")


def print_plan(result: dict, name: str) -> None:
    rows = [("source", result["source"]), ("device", f"{name} ({result['device_source']}): "
                                                       f"{result['device_flops'] / 1e12:.3g} TFLOP/s"),
            ("compute per step", f"{result['t_compute_s']:.3f} s"), ("PP per step", f"{result['t_pp_s']:.3f} s"),
            ("DP per step", f"{result['t_dp_s']:.3f} s"),
            ("step time (serialised / overlapped)",
             f"{result['step_time_s']:.3f} s / {result['step_time_overlapped_s']:.3f} s"),
            ("tokens/s (serialised / overlapped)",
             f"{result['tokens_per_s']:.0f} / {result['tokens_per_s_overlapped']:.0f}"),
            ("schedule simulation: pipeline / bubble", f"{result['des_pipeline_s']:.3f} s / "
                                                       f"{result['des_bubble_fraction']:.1%}"),
            ("schedule simulation: tokens/s (serialised / overlapped)",
             f"{result['des_tokens_per_s']:.0f} / {result['des_tokens_per_s_overlapped']:.0f}"),
            ("schedule simulation, links shared by replicas: tokens/s", f"{result['des_shared_tokens_per_s']:.0f}")]
    rows += [(f"bytes/token {axis}", f"{v:.1f}") for axis, v in result["bytes_per_token"].items()]
    rows.insert(len(rows) - len(result["bytes_per_token"]) + 1, ("PP compression", compression_text(result)))
    if "k_stale" in result:
        rows += [("anchor T_pull / T_clean / T_push", f"{result['t_pull_s']:.2f} / {result['t_clean_s']:.2f} / "
                                                      f"{result['t_push_s']:.2f} s"),
                 ("anchor staleness K_stale (overlapped)",
                  f"{result['k_stale']:.1f} ({result['k_stale_overlapped']:.1f}) steps")]
    if "churn" in result:
        c = result["churn"]
        rows += [(f"with replica churn (MTBF {c['replica_mtbf_h']:g} h each, restart {c['restart_s']:g} s)",
                  f"{c['tokens_per_s']:.0f} tokens/s ({c['failures_per_hour']:.2g} failures/h; each stalls the job "
                  f"{c['stall_per_failure_s']:.1f} s, a replica missing {c['replica_absent_per_failure_s']:.1f} s)")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if "memory" in result:
        print_memory(result["memory"])


def print_memory(memory: dict) -> None:
    """Each rank's predicted peak and its parts (GiB), and ``--memory-gb``'s verdict."""
    gib = 2 ** 30
    parts = list(memory["ranks"][0]["parts_bytes"])
    print(f"\npeak memory per rank on {memory['device']} ({memory['tokens_per_microbatch']:,} tokens per microbatch, "
          f"activation checkpointing {'on' if memory['activation_checkpointing'] else 'off'}), GiB:")
    other = memory.get("other_checkpointing")
    head = ["stage", "layers", "in flight", *parts, "training", "job end", "peak",
            *([f"peak {other} checkpointing"] if other else [])]
    rows = [[str(r["stage"]), str(r["layers"]), str(r["microbatches_in_flight"]),
             *(f"{r['parts_bytes'][p] / gib:.2f}" for p in parts), f"{r['training_peak_bytes'] / gib:.2f}",
             f"{r['end_peak_bytes'] / gib:.2f}" if "end_peak_bytes" in r else "-", f"{r['peak_bytes'] / gib:.2f}",
             *([f"{r[f'peak_bytes_{other}_checkpointing'] / gib:.2f}"] if other else [])]
            for r in memory["ranks"]]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    for row in [head, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    print(f"({memory['source']}; job end: the rank that writes the job's model holds all of it, the others a copy "
          "of their share; on a GPU that is host memory, apart)")
    if memory.get("not_modelled"):
        print(f"not modelled: {'; '.join(memory['not_modelled'])}")
    f = memory.get("fit")
    if f is None:
        return
    if f["fits"]:
        print(f"fits {f['memory_gb']:g} GiB: every rank")
    elif f["change"]:
        print(f"does not fit {f['memory_gb']:g} GiB (stages {', '.join(map(str, f['stages_over']))}); the cheapest "
              f"change that fits ({f['change']}, largest rank {f['largest_peak_bytes'] / gib:.2f} GiB): "
              + " ".join(f"--set {k}={v}" for k, v in f["settings"].items()))
    else:
        print(f"does not fit {f['memory_gb']:g} GiB (stages {', '.join(map(str, f['stages_over']))}), and neither "
              "more microbatches, activation checkpointing, a split by memory nor LoRA makes it fit: more stages "
              "(mesh.pp) or a larger device")


def print_advice(advice: dict, device: str, as_json: bool) -> int:
    advice["device"] = device
    if as_json:
        print(json.dumps(advice, indent=2))
        return 0 if advice["feasible"] else 1
    print(f"goal: {advice['goal']} on {device}; {advice['searched']} settings searched within p <= "
          f"{advice['limits']['p_max']}, PowerSGD <= {advice['limits']['powersgd_max_x']:g}x, H <= "
          f"{advice['limits']['h_max']}" + (f", K_stale <= {advice['limits']['k_stale_max']:g}"
                                            if advice["limits"]["k_stale_max"] else ""))
    print(f"quality: {advice['quality']}")
    if not advice["feasible"]:
        print(f"no setting meets it: {advice['why']}")
        return 1
    r = advice["plan"]
    if "per_boundary" in advice:  # uneven links: a codec per boundary, as a config for `thinpipe train --config`
        print("a codec per boundary, the least compression each link needs:")
        for pb in advice["per_boundary"]:
            print(f"  boundary {pb['boundary']} ({pb['link_mbps']:g} Mbit/s): {pb['arm']}"
                  + (f" (forward damage {pb['damage']:+.2%})" if "damage" in pb else ""))
        print("as a config (save it and pass it: thinpipe train --config advice.toml):")
        print(advice["config_toml"].rstrip())
        r = {**r, "dp_compression_x": r.get("dp_compression_x", 1.0),
             "bytes_per_token_total": sum(r["bytes_per_token"].values())}
        print(f"  tokens/s {r['tokens_per_s']:.0f} (overlapped {r['tokens_per_s_overlapped']:.0f}), step "
              f"{r['step_time_s']:.3f} s = compute {r['t_compute_s']:.3f} + PP {r['t_pp_s']:.3f} + DP "
              f"{r['t_dp_s']:.3f}")
        return 0
    print("least compression that meets it:  " + " ".join(f"--set {k}={v}" for k, v in advice["settings"].items()))
    print(f"  tokens/s {r['tokens_per_s']:.0f} (overlapped {r['tokens_per_s_overlapped']:.0f}), step "
          f"{r['step_time_s']:.3f} s = compute {r['t_compute_s']:.3f} + PP {r['t_pp_s']:.3f} + DP {r['t_dp_s']:.3f}, "
          f"{r['bytes_per_token_total']:.0f} B/token, PP {compression_text(r)}, DP compression "
          f"{r['dp_compression_x']:.0f}x"
          + (f", K_stale {r['k_stale']:.1f}" if "k_stale" in r else "")
          + (f", forward damage {advice['damage']:+.2%}" if "damage" in advice else ""))
    return 0
