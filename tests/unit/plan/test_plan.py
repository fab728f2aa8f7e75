"""The planner's closed form (anchor-priors App. J.1, H.1-H.4) against hand-computed values and the
paper's own worked numbers; monotonicity; clear errors."""

import json
import re

import pytest

from thinpipe.cli import main
from thinpipe.config import ConfigError, load_config
from thinpipe.plan import closed_form as cf
from thinpipe.plan.planner import DEVICES, PRESETS, plan

MB = 1e6
B200 = 200e6 / 8  # 200 Mbit/s = 25 MB/s


def test_app_j_formulas_on_a_small_hand_computed_example():
    # K=3 stages, S=100 tokens, H=10, 2-byte elements, half the activations, 1000 B/s:
    # 2 * 2 * 100 * 10 * 2 * 0.5 / 1000 = 4 s
    assert cf.t_pp_s(3, 100, 10, 2, 0.5, 1000) == pytest.approx(4.0)
    # D=4, N=1000, 4 bytes, rho 1/4, tau 2, 100 B/s: 2 * 3/4 * 1000 * 4 * 0.25 / (100 * 2) = 7.5 s
    assert cf.t_dp_s(4, 1000, 4, 0.25, 2, 100) == pytest.approx(7.5)
    assert cf.t_dp_s(1, 1000, 4, 1, 1, 100) == 0.0
    assert cf.step_time_s(1, 4, 7.5, overlapped=True) == 7.5
    assert cf.step_time_s(1, 4, 7.5, overlapped=False) == 12.5
    assert cf.k_stale(2, 10, 1, 0.5) == pytest.approx(26.0)
    assert cf.k_stale(12, 10, 1, 0.5, overlap=True) == pytest.approx(24.0)


def test_the_papers_worked_numbers_app_h2_and_j1():
    """App. H.2: T_pull ~ 12 s, T_clean ~ 72 s (1.8 GB at 25 MB/s; exactly 75 s for 8 MiB-ish
    activations of 2048 x 2048 x 2 B), T_mask ~ 3.8 s, K_stale ~ 23; App. J.1: uncompressed DP ~ 168 s."""
    assert cf.t_pull_s(1.2e9, 8, 2, B200) == pytest.approx(12.0)
    t_clean = cf.t_pp_s(8, 16 * 2048, 2048, 2, 1.0, B200)
    assert t_clean == pytest.approx(2 * 7 * 16 * 2048 * 2048 * 2 / B200) and 72 <= t_clean <= 76
    t_mask = t_clean / 20 + 1.2e9 * 2 / 64 / (B200 * 10)  # the paper's own expression for T_mask
    assert t_mask == pytest.approx(3.9, abs=0.1)
    assert cf.k_stale(12, t_clean, 2, t_mask) == pytest.approx(23, abs=1)
    assert cf.t_dp_s(8, 1.2e9, 2, 1, 1, B200) == pytest.approx(168, abs=0.1)


def _plan(**sets):
    s = {**PRESETS["paper-llama1b"], **{k.replace("__", "."): str(v) for k, v in sets.items()}}
    return plan(load_config(None, [f"{k}={v}" for k, v in s.items()]), DEVICES["a100-40gb"])


def test_paper_preset_reproduces_table_1_throughput_within_20_percent():
    paper = {"Baseline": 1.1e3, "+DP": 3.6e3, "M90": 29.3e3, "M95": 48.9e3}
    got = {"Baseline": _plan(dp__kind="allreduce", dp__rank=0)["tokens_per_s"], "+DP": _plan()["tokens_per_s"],
           "M90": _plan(boundary__kind="mask", boundary__p=0.9)["tokens_per_s"],
           "M95": _plan(boundary__kind="mask", boundary__p=0.95)["tokens_per_s"]}
    for arm, tps in paper.items():
        assert abs(got[arm] / tps - 1) < 0.2, (arm, got[arm], tps)
    ap = _plan(boundary__kind="mask", boundary__p=0.95, mesh__anchor=1)
    assert 15 <= ap["k_stale"] <= 25  # the paper observes 20-25 steps


def test_monotone_in_bandwidth_and_mask_ratio():
    slow, fast = _plan(link__pp_mbps=100, link__dp_mbps=100), _plan(link__pp_mbps=400, link__dp_mbps=400)
    assert fast["tokens_per_s"] > slow["tokens_per_s"]
    pp = [_plan(boundary__kind="mask", boundary__p=p)["bytes_per_token"]["pp"] for p in (0.5, 0.9, 0.95, 0.99)]
    assert pp == sorted(pp, reverse=True)


@pytest.mark.parametrize("sets, message", [
    (["link.pp_mbps=0"], "needs link bandwidths"),
    (["mesh.pp=32"], "has 16 layers"),
    (["model.name=gpt-17"], "knows no architecture"),
    (["boundary.kind=mapl"], "identity, mask, topk"),
])
def test_bad_inputs_give_one_line_errors(sets, message, capsys):
    args = ["plan", "--preset", "paper-llama1b"] + [x for s in sets for x in ("--set", s)]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_unknown_preset_and_device(capsys):
    assert main(["plan", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert main(["plan", "--preset", "paper-llama1b", "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_plan_json_has_the_promised_keys(capsys):
    assert main(["plan", "--preset", "paper-llama1b", "--set", "boundary.kind=mask", "--set", "boundary.p=0.95",
                 "--set", "mesh.anchor=1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("tokens_per_s", "step_time_s", "t_compute_s", "t_pp_s", "t_dp_s", "k_stale", "bytes_per_token"):
        assert key in r
    assert set(r["bytes_per_token"]) == {"pp", "dp", "anchor"}


from thinpipe.plan.des import PipelineStep, simulate  # noqa: E402


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_des_without_communication_shows_the_pipeline_bubble(schedule):
    """Compute only: makespan (M + K - 1)(f + b), idle fraction (K - 1) / (M + K - 1)."""
    K, M, f, b = 4, 6, 1.0, 2.0
    r = simulate(PipelineStep(K, M, f, b, 0, 0, 1.0, 0.0, schedule))
    assert r["makespan_s"] == pytest.approx((M + K - 1) * (f + b))
    assert 1 - r["busy_fraction"] == pytest.approx((K - 1) / (M + K - 1))


def test_des_equals_the_closed_form_without_overlap_or_bubble():
    """One microbatch, no compute: every transfer waits for the previous one, as App. J.1 assumes."""
    K, S, H, b, rho, B = 5, 256, 64, 2, 0.05, 1000.0
    msg = S * H * b * rho
    r = simulate(PipelineStep(K, 1, 0.0, 0.0, msg, msg, B))
    assert r["makespan_s"] == pytest.approx(cf.t_pp_s(K, S, H, b, rho, B))


def test_des_overlaps_transfers_on_different_links_and_adds_latency():
    K, M, msg, B = 4, 8, 1000.0, 1000.0
    serial = 2 * (K - 1) * M * msg / B                     # the closed form: one link, one after another
    r = simulate(PipelineStep(K, M, 0.0, 0.0, msg, msg, B))
    assert r["makespan_s"] < serial
    slow = simulate(PipelineStep(K, M, 0.0, 0.0, msg, msg, B, latency_s=0.5))
    assert slow["makespan_s"] > r["makespan_s"]
    faster = simulate(PipelineStep(K, M, 0.0, 0.0, msg, msg, 2 * B))
    assert faster["makespan_s"] < r["makespan_s"]


def test_des_token_bucket_links_as_a_kernel_shaper():
    """burst 0 is the pure-rate link; a message the full bucket covers costs only latency; back to
    back, the second pays for what the first left of the bucket; an idle gap refills it."""
    K, f, b_s, msg, B, lat = 2, 1.0, 2.0, 1000.0, 1000.0, 0.25
    pure = simulate(PipelineStep(K, 1, f, b_s, msg, msg, B, lat))
    assert simulate(PipelineStep(K, 1, f, b_s, msg, msg, B, lat, burst_bytes=0.0)) == pure
    assert pure["makespan_s"] == pytest.approx(f + 1 + lat + f + b_s + 1 + lat + b_s)  # 1 s per message
    covered = simulate(PipelineStep(K, 1, f, b_s, msg, msg, B, lat, burst_bytes=msg))
    assert covered["makespan_s"] == pytest.approx(f + lat + f + b_s + lat + b_s)
    # no compute, two microbatches, GPipe: the two forwards go back to back on one link; a bucket of
    # 1.5 messages: the first is free, the second pays 0.5 s; the backward link's bucket is untouched
    two = simulate(PipelineStep(K, 2, 0.0, 0.0, msg, msg, B, 0.0, "gpipe", burst_bytes=1.5 * msg))
    assert two["makespan_s"] == pytest.approx(0.5 + 0.5)   # backward: first free, second pays 0.5 s


def test_bench_prediction_without_links_gives_back_the_calibration_step():
    """The bench's model: with links that cost no time the predicted step is the measured
    unshaped step T0 (an (M + K - 1)-slot pipeline of f + b = T0 / (M + K - 1)); each message's
    header is on the wire even when the metered payload is nothing."""
    from thinpipe.comm.header import HEADER_BYTES
    from thinpipe.commands.bench import BASE, predict_step_s

    shaped = {"tokens": 2560, "steps": 10, "bytes_per_token": {"pp_fwd": 0, "pp_bwd": 0, "pp_params": 0, "dp": 0}}
    assert predict_step_s(0.3, shaped, BASE, 1e12, 1e12, 0.0) == pytest.approx(0.3)
    headers_only = predict_step_s(0.3, shaped, BASE, 4.0, 4.0, 0.0)
    assert headers_only >= 0.3 + HEADER_BYTES * 8 / 4e6 - 1e-12   # at least one header on the critical path
    with_links = predict_step_s(0.3, {**shaped, "bytes_per_token": {"pp_fwd": 512, "pp_bwd": 512, "pp_params": 0,
                                                                    "dp": 0}}, BASE, 4.0, 4.0, 5.0)
    assert with_links > 0.3


# --- advice: --target-tps / --max-mbps -------------------------------------------------------

from thinpipe.plan.advice import MAX_STALENESS, advise, candidates  # noqa: E402


def _cfg(*sets):
    s = {**PRESETS["paper-llama1b"]}
    s.update(dict(x.split("=", 1) for x in sets))
    return load_config(None, [f"{k}={v}" for k, v in s.items()])


@pytest.mark.parametrize("target", [2000, 3000, 30000, 45000])
def test_advice_meets_the_target_with_the_least_compression(target):
    cfg, dev = _cfg(), DEVICES["a100-40gb"]
    a = advise(cfg, dev, target_tps=target)
    assert a["feasible"] and a["plan"]["tokens_per_s"] >= target
    chosen = (float(a["settings"].get("boundary.p", 0)), a["plan"]["dp_compression_x"])
    # every setting that is less compressed in the advice's order misses the target
    for c in candidates(cfg, dev):
        if (c.p, c.dp_compression_x) < chosen:
            assert c.result["tokens_per_s"] < target
    # and the stability limits hold
    assert chosen[0] <= 0.95 and a["plan"]["powersgd_x"] <= 64


def test_advice_asks_for_more_compression_as_the_target_rises():
    cfg, dev = _cfg(), DEVICES["a100-40gb"]
    order = [advise(cfg, dev, target_tps=t) for t in (1000, 3000, 10000, 30000, 50000)]
    keys = [(float(a["settings"].get("boundary.p", 0)), a["plan"]["dp_compression_x"]) for a in order]
    assert keys == sorted(keys)


def test_advice_says_when_no_setting_can_and_why(capsys):
    a = advise(_cfg(), DEVICES["a100-40gb"], target_tps=1e6)
    assert not a["feasible"] and "bound by PP" in a["why"]
    assert main(["plan", "--preset", "paper-llama1b", "--target-tps", "1e6"]) == 1
    assert "no setting meets it" in capsys.readouterr().out


def test_advice_respects_the_anchor_staleness_limit():
    """Compressing more shortens the fast step and so makes the anchor's priors staler (App. H)."""
    cfg = _cfg("mesh.anchor=1", "link.dp_mbps=100")
    a = advise(cfg, DEVICES["a100-40gb"], target_tps=57000)
    assert not a["feasible"] and "too stale" in a["why"]
    ok = advise(cfg, DEVICES["a100-40gb"], target_tps=20000)
    assert ok["feasible"] and ok["plan"]["k_stale"] <= MAX_STALENESS


def test_max_mbps_sets_the_links_and_asks_that_they_keep_up():
    """A 10 GFLOP/s device on a small model: slower links need more compression to keep up."""
    from thinpipe.plan.device import Device

    cfg = _cfg("model.name=small-llama", "mesh.pp=2", "mesh.dp=2", "train.seq_len=256", "train.microbatches=4")
    keys = []
    for mbps in (100, 10, 1, 0.5):
        a = advise(cfg, Device(1e10, 1.0), max_mbps=mbps)
        assert a["feasible"] and f"{mbps:g} Mbit/s" in a["goal"]
        assert max(a["plan"]["t_pp_s"], a["plan"]["t_dp_s"]) <= a["plan"]["t_compute_s"]
        keys.append((float(a["settings"].get("boundary.p", 0)), a["plan"]["dp_compression_x"]))
    assert keys == sorted(keys) and keys[0] == (0.0, 1.0) and keys[-1][0] == 0.95


@pytest.mark.parametrize("args, message", [(["--target-tps", "0"], "--target-tps must be > 0"),
                                           (["--max-mbps", "-1"], "--max-mbps must be > 0")])
def test_advice_bad_inputs(args, message, capsys):
    assert main(["plan", "--preset", "paper-llama1b"] + args) == 2
    assert message in capsys.readouterr().err


# --- device profiles and shared links ---------------------------------------------------------

def test_cpu_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    from thinpipe.plan import device as dv
    from thinpipe.plan.planner import ARCHITECTURES

    monkeypatch.setenv("THINPIPE_CACHE", str(tmp_path))
    first = dv.resolve_device("cpu", ARCHITECTURES["tiny-llama"], "float32")
    assert first.peak_flops > 1e6 and first.mfu == 1.0 and "measured" in first.source
    assert (tmp_path / "device_profiles.json").is_file()
    monkeypatch.setattr(dv.time, "perf_counter", lambda: pytest.fail("measured again despite the cache"))
    assert dv.resolve_device("cpu", ARCHITECTURES["tiny-llama"], "float32") == first


def test_measure_runs_its_timed_path_on_a_cpu_device(tmp_path, monkeypatch):
    """``measure`` is the one path of ``--device cpu`` and ``--device cuda``; on a CPU device it runs
    whole (windows of several steps, bf16 autocast, a shape given), caches under its own key, and
    times every step it is asked to."""
    import torch

    from thinpipe.plan import device as dv
    from thinpipe.plan.planner import ARCHITECTURES

    monkeypatch.setenv("THINPIPE_CACHE", str(tmp_path))
    arch, cpu = ARCHITECTURES["tiny-llama"], torch.device("cpu")
    calls = []
    real = dv.time.perf_counter
    monkeypatch.setattr(dv.time, "perf_counter", lambda: calls.append(1) or real())
    got = dv.measure(cpu, arch, "bfloat16", shape=(2, 32), steps_per_window=3)
    assert got.mfu == 1.0 and got.peak_flops > 1e6 and "bfloat16" in got.source and "64 tokens" in got.source
    assert len(calls) == 2 * dv.MEASURE_REPEATS  # one clock pair per window, not per step
    saved = json.loads((tmp_path / "device_profiles.json").read_text())
    assert list(saved) == [dv._cache_key(arch, "bfloat16", cpu, 2, 32)] and "tokens=2x32" in list(saved)[0]
    # the default CPU shape keeps the key profiles were cached under before shapes were part of it
    assert "tokens=" not in dv._cache_key(arch, "float32", cpu, 1, dv.MEASURE_TOKENS)


def test_cuda_profile_key_names_the_gpu(monkeypatch):
    """Two GPUs (or two torch builds) never share a cached profile."""
    import torch

    from thinpipe.plan import device as dv
    from thinpipe.plan.planner import ARCHITECTURES

    arch = ARCHITECTURES["smollm2-135m"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    h200 = dv._cache_key(arch, "bfloat16", torch.device("cuda", 0), 8, 1024)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-40GB")
    a100 = dv._cache_key(arch, "bfloat16", torch.device("cuda", 0), 8, 1024)
    assert "gpu=NVIDIA H200" in h200 and f"torch={torch.__version__}" in h200 and h200 != a100


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_plan_device_cuda_without_a_gpu_is_one_line_exit_2(device, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a machine that has one
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["plan", "--set", "model.name=smollm2-135m", "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: --device {device} needs a CUDA GPU here")
    assert "use a data-sheet device: a100-40gb, h100, rtx-4090" in err


def test_plan_device_cuda_index_beyond_the_gpus_is_one_line_exit_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["plan", "--set", "model.name=smollm2-135m", "--device", "cuda:3"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --device cuda:3: this machine has 1 CUDA device(s): use cuda:0..cuda:0\n"


def test_plan_without_cuda_exits_2_through_the_command_line():
    """The real command, as a user runs it on a machine without a GPU: one line, no traceback."""
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the in-process tests above cover the error path here")
    r = subprocess.run([sys.executable, "-m", "thinpipe", "plan", "--device", "cuda"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: --device cuda needs a CUDA GPU here"), r.stderr


def test_plan_on_a_data_sheet_device_does_not_import_torch():
    """plan/device.py imports torch only to measure (kept that way: plan on a preset starts fast)."""
    import subprocess
    import sys

    code = ("import sys; from thinpipe.plan import device as dv; from thinpipe.plan.planner import ARCHITECTURES; "
            "dv.resolve_device('h100', ARCHITECTURES['smollm2-135m'], 'bfloat16'); print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_shared_links_slow_the_pipeline_by_the_replica_count():
    one = _plan(boundary__kind="mask", boundary__p=0.95, mesh__dp=1)
    assert one["des_shared_pipeline_s"] == pytest.approx(one["des_pipeline_s"])
    seven = _plan(boundary__kind="mask", boundary__p=0.95)
    assert seven["des_shared_pipeline_s"] > 3 * seven["des_pipeline_s"]


# rho_act of every kind on SmolLM2 (H 576) at fp32, as the planner's own copy of each kind's byte formula gave it
# before issue 49 (an if-chain in plan/planner.py); the planner now asks the built boundary
# (Boundary.planned_bytes), which must give the same figures: exactly where a fraction of tokens or tiles is dyadic,
# to ~1e-9 where the boundary rounds a token or tile count (at 2^30 tokens).
BEFORE_ISSUE_49 = [
    ([], 1.0),
    (["kind=mask"], 0.050347222222222224),
    (["kind=mask", "p=0.5"], 0.5),
    (["kind=topk"], 0.06293402777777778),
    (["kind=topk", "p=0.7"], 0.3754340277777778),
    (["kind=bottleneck"], 0.050347222222222224),
    (["kind=quant4"], 0.140625),
    (["kind=quant2"], 0.078125),
    (["kind=quant2", "bwd_bits=8"], 0.171875),
    (["kind=quant4", "quant_group=0"], 0.1267361111111111),
    (["kind=aqsgd"], 0.171875),  # its steady state: every row revisited
    (["kind=tahquant"], 0.177734375),
    (["kind=tahquant", "tahquant.high_fraction=0.3", "quant_group=32"], 0.19609375),
    (["kind=outlier"], 0.0920138888888889),
    (["kind=outlier", "outlier.grid=lloyd-max", "outlier.scale_group=-1", "outlier.bwd_scale_group=-1",
      "outlier.dtype=bfloat16", "fwd_bits=4", "bwd_bits=1"], 0.0859375),
    (["kind=outlier", "outlier_bwd_tokens=0.3", "outlier_channels=8"], 0.05775282118055556),
    (["kind=outlier", "outlier_bwd_tokens=0.5", "outlier_grid=lloyd-max"], 0.066650390625),
    (["kind=outlier", "compress=fwd"], 0.5529513888888888),
    (["kind=outlier", "compress=bwd"], 0.5390625),
    (["kind=outlier", "outlier.fwd_bits=[3,4,2]", "mesh.pp=4"], 0.1076388888888889),  # the mean of the boundaries'
    (["kind=klt"], 0.05710177951388889),  # its bound: every token scored
    (["kind=klt", "klt.bits=3.5", "klt.bwd_tokens=1", "klt.channels=0"], 0.07118055555555555),
    (["kind=klt", "klt_bwd_tokens=0.3", "bwd_bits=2", "klt_scale=token"], 0.058577473958333334),
]


@pytest.mark.parametrize("sets, rho", BEFORE_ISSUE_49, ids=[" ".join(s) or "identity" for s, _ in BEFORE_ISSUE_49])
def test_the_planner_asks_the_boundary_and_its_figures_are_those_of_before(sets, rho):
    from thinpipe.plan.planner import ARCHITECTURES, activation_fraction

    cfg = load_config(None, ["model.name=smollm2-135m", "mesh.pp=2", "train.dtype=float32", "link.pp_mbps=100",
                             *[s if s.startswith("mesh.") else f"boundary.{s}" for s in sets]])
    assert activation_fraction(cfg, ARCHITECTURES["smollm2-135m"], 4) == pytest.approx(rho, rel=1e-8, abs=0)


def test_a_kind_that_needs_the_model_is_refused_by_what_it_says_not_by_name():
    from thinpipe.config import BOUNDARY_KINDS

    for kind in ("ssn", "mapl", "mapl-vq"):
        cfg = load_config(None, ["model.name=smollm2-135m", "mesh.pp=2", "link.pp_mbps=100", f"boundary.kind={kind}"])
        with pytest.raises(ConfigError, match=f"not '{kind}': {re.escape(BOUNDARY_KINDS[kind].needs_model)}"):
            plan(cfg, DEVICES["a100-40gb"])


WIRE_KINDS = {"identity": {}, "mask": {"boundary.p": "0.9"}, "topk": {"boundary.p": "0.9"}, "quant4": {},
              # the demo's arm (intact channels in bf16), and its intact channels on the wire dtype
              "outlier": {"boundary.fwd_bits": "4", "boundary.bwd_bits": "1", "boundary.outlier_channels": "4",
                          "boundary.quant_group": "16", "boundary.outlier_scale_group": "-1",
                          "boundary.outlier_dtype": "bfloat16"}}
WIRE_KINDS["outlier-wire"] = {**WIRE_KINDS["outlier"], "boundary.outlier_dtype": "wire"}


@pytest.fixture(scope="module")
def metered():
    """PP bytes per token the simulated mesh's meter counts for each kind on an fp32 and a bf16 wire
    (tiny-llama, 2 stages, one step of 2 x 16 tokens), with the plan of the same config."""
    from tests.helpers import tiny_batch, tiny_model
    from thinpipe.engine.sim_mesh import SimMesh

    out = {}
    for wire in ("float32", "bfloat16"):
        for kind, extra in WIRE_KINDS.items():
            sets = {"model.name": "tiny-llama", "mesh.pp": "2", "train.batch_size": "2", "train.seq_len": "16",
                    "link.pp_mbps": "100", "boundary.kind": kind.split("-")[0], "boundary.dtype": wire, **extra}
            cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
            mesh = SimMesh(tiny_model("llama"), cfg)
            mesh.forward_backward([tiny_batch(batch_size=2, seq_len=16)])
            measured = (mesh.meter.totals["pp_fwd"] + mesh.meter.totals["pp_bwd"]) / 32
            out[wire, kind] = measured, plan(cfg, DEVICES["a100-40gb"])
    return out


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["mask", "topk", "quant4", "outlier", "outlier-wire"])
def test_closed_form_bytes_and_compression_equal_the_meter_on_either_wire(metered, kind, wire):
    """Issue 26: the plan's PP bytes are the meter's on the wire boundary.dtype sets, and its
    compression is against Dense on that same wire, named in the result."""
    got, r = metered[wire, kind]
    dense, dense_plan = metered[wire, "identity"]
    assert r["bytes_per_token"]["pp"] == pytest.approx(got, rel=1e-12)
    assert r["dense_pp_bytes_per_token"] == dense_plan["bytes_per_token"]["pp"] == dense == 2 * 64 * (
        2 if wire == "bfloat16" else 4)
    assert r["pp_wire_dtype"] == wire and r["pp_compression_x"] == pytest.approx(dense / got, rel=1e-12)


def test_codes_do_not_shrink_on_a_bf16_wire_but_values_do(metered):
    """A quantiser's codes are the same bytes on either wire, so its ratio against a bf16 Dense is
    half its ratio against an fp32 one; masking's values halve with Dense's; top-K's values halve but
    not their int16 indices, and an outlier's intact channels in the wire dtype halve but not its codes."""
    for kind in ("quant4", "outlier"):
        assert metered["bfloat16", kind][0] == metered["float32", kind][0]
        assert metered["bfloat16", kind][1]["pp_compression_x"] == pytest.approx(
            metered["float32", kind][1]["pp_compression_x"] / 2)
    assert metered["bfloat16", "mask"][0] == metered["float32", "mask"][0] / 2
    assert metered["bfloat16", "mask"][1]["pp_compression_x"] == pytest.approx(
        metered["float32", "mask"][1]["pp_compression_x"])
    for kind in ("topk", "outlier-wire"):  # top-K's int16 indices and the outlier's codes stay; their values halve
        fp32, bf16 = (metered[w, kind][1]["pp_compression_x"] for w in ("float32", "bfloat16"))
        assert fp32 / 2 < bf16 < fp32, kind
    # the 4 intact channels of 32 tokens in fp32, then in bf16: 2 B each fewer
    assert metered["float32", "outlier-wire"][0] - metered["bfloat16", "outlier-wire"][0] == 4 * 2


def test_the_plan_resolves_auto_on_its_device_and_prints_the_wire_it_compares_against(capsys):
    """train.dtype = auto is bf16 on a GPU profile: Dense sends 2 B per value there, and the printed
    ratio says so; boundary.dtype = float32 keeps an fp32 wire on the same device."""
    base = ["plan", "--set", "model.name=smollm2-135m", "--set", "mesh.pp=4", "--set", "link.pp_mbps=200",
            "--set", "boundary.kind=quant4"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "bytes/token pp" in out and "3.6x (against Dense on this plan's bf16 wire: 6,912 B/token)" in out
    assert main([*base, "--set", "boundary.dtype=float32", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["pp_wire_dtype"] == "float32" and r["dense_pp_bytes_per_token"] == 13_824
    assert r["bytes_per_token"]["pp"] == 1944 and r["pp_compression_x"] == pytest.approx(13_824 / 1944)


def test_lora_shrinks_dp_and_anchor_bytes_to_the_adapters_not_pp():
    full = _plan(boundary__kind="mask", boundary__p=0.95, mesh__anchor=1, dp__kind="allreduce", dp__rank=0)
    lora = _plan(boundary__kind="mask", boundary__p=0.95, mesh__anchor=1, dp__kind="allreduce", dp__rank=0,
                 train__lora__rank=16)
    # Llama-3.2-1B, r = 16 on all 7 linear maps of 16 layers: 16 x 16 x (2048+2048 + 2048+512 + 2048+512
    # + 2048+2048 + 2048+8192 + 2048+8192 + 8192+2048) = 11.27 M adapter parameters
    assert lora["trained_params"] == 16 * 16 * (4096 * 2 + 2560 * 2 + 10240 * 3)
    assert lora["bytes_per_token"]["pp"] == full["bytes_per_token"]["pp"]
    ratio = lora["trained_params"] / full["params"]
    assert lora["bytes_per_token"]["dp"] == pytest.approx(full["bytes_per_token"]["dp"] * ratio)
    assert lora["t_pull_s"] == pytest.approx(full["t_pull_s"] * ratio)


def test_bench_steady_step_leaves_out_the_warm_up_steps():
    from thinpipe.commands.bench import steady_step_s

    walls = [1.0, 1.1, 1.2, 1.3, 1.4] + [1.4 + 0.05 * i for i in range(1, 11)]  # 1 s start-up, then 0.05 s
    assert steady_step_s(walls, skip=5) == pytest.approx(0.05)
    assert steady_step_s(walls[:3], skip=5) == pytest.approx(1.2 / 3)


def test_bench_calibration_is_the_fast_circuit_over_free_links():
    """T0 has no link time and no anchor in it (the planner puts the anchor off the critical path)."""
    from thinpipe.commands.bench import ARMS, BASE, CALIBRATION_MBPS, calibration

    shaped = {"link.pp_mbps": 4.0, "link.pp_latency_ms": 5.0, "link.dp_mbps": 4.0, "link.dp_latency_ms": 5.0}
    for arm in ("M95", "M95+AP", "M95+AP + PowerSGD r4, 2 replicas"):
        cal = calibration({**BASE, **ARMS[arm], **shaped}, 60)
        assert cal["link.pp_mbps"] == cal["link.dp_mbps"] == CALIBRATION_MBPS and cal["train.steps"] == 60
        assert cal["link.pp_latency_ms"] == cal["link.dp_latency_ms"] == 0
        assert cal.get("mesh.anchor", 0) == 0 and not any(k.startswith("anchor.") for k in cal)
        assert cal.get("mesh.dp", 1) == ARMS[arm].get("mesh.dp", 1)   # the fast circuit as measured


# -- the seed's Table 6: M95+AP at 200 Mbps as the mesh grows (one DP replica is the anchor) ---------
TABLE6 = [(4, 4, 32100), (8, 4, 75000), (4, 8, 19900), (8, 8, 46500), (16, 8, 99600), (8, 16, 26400),
          (16, 16, 56600)]


def _table6(dp: int, pp: int) -> dict:
    return _plan(mesh__dp=dp - 1, mesh__anchor=1, mesh__pp=pp, boundary__kind="mask", boundary__p=0.95)


def test_table6_the_closed_form_follows_the_paper_and_its_replicas_scale_linearly():
    """Table 6's TPS is proportional to DP - 1 at fixed PP (75,000 / 32,100 = 2.34 = 7/3): every fast
    replica adds its own throughput, so no link is shared between replicas. The closed form (a
    replica's boundaries each on its own link, transfers serialised) follows it: within 40% on every
    mesh (measured: +3% to +38%, largest at 4 x 4), and the DP ratios within 5%. The simulation of
    links shared by the replicas cannot: it barely grows with replicas."""
    got = {(dp, pp): _table6(dp, pp) for dp, pp, _ in TABLE6}
    paper = {(dp, pp): tps for dp, pp, tps in TABLE6}
    for key, tps in paper.items():
        assert 1.0 <= got[key]["tokens_per_s"] / tps <= 1.4, (key, got[key]["tokens_per_s"], tps)
    for small, big in (((4, 4), (8, 4)), ((8, 8), (16, 8)), ((8, 16), (16, 16))):
        ratio = paper[big] / paper[small]
        assert got[big]["tokens_per_s"] / got[small]["tokens_per_s"] == pytest.approx(ratio, rel=0.05)
        assert got[big]["des_shared_tokens_per_s"] / got[small]["des_shared_tokens_per_s"] < 0.7 * ratio
    for dp in (4, 8, 16):  # deeper pipelines: fewer tokens/s per replica, as in the paper
        pps = sorted(pp for d, pp in paper if d == dp)
        assert [got[(dp, pp)]["tokens_per_s"] / (dp - 1) for pp in pps] == \
            sorted((got[(dp, pp)]["tokens_per_s"] / (dp - 1) for pp in pps), reverse=True)


def test_churn_costs_a_stall_per_failure_and_a_missing_replica_meanwhile():
    from thinpipe.plan.churn import churn_tokens_per_s

    # 3 replicas failing once an hour each: 3 failures/h; each stalls the job 5 s + the redone 1 s step,
    # and leaves its replica out for max(5, 6) s + 0.5 s of healing
    c = churn_tokens_per_s(1000.0, 1.0, 3, 3600.0, 5.0, 6.0, 0.5)
    assert c["stall_per_failure_s"] == 6.0 and c["replica_absent_per_failure_s"] == 6.5
    assert c["tokens_per_s"] == pytest.approx(1000 * (1 - 3 * 6 / 3600) * (1 - 6.5 / 3600))
    assert c["failures_per_hour"] == pytest.approx(3.0)


def test_plan_adds_the_churn_row_only_when_asked(capsys):
    assert main(["plan", "--preset", "paper-llama1b", "--json"]) == 0
    assert "churn" not in json.loads(capsys.readouterr().out)
    assert main(["plan", "--preset", "paper-llama1b", "--json", "--replica-mtbf-h", "2", "--restart-s", "30"]) == 0
    r = json.loads(capsys.readouterr().out)
    c = r["churn"]
    assert c["restart_s"] == 30 and 0 < c["tokens_per_s"] < r["tokens_per_s"]
    assert c["stall_per_failure_s"] == pytest.approx(5.0 + r["step_time_s"])
    assert main(["plan", "--preset", "paper-llama1b", "--replica-mtbf-h", "0"]) == 2


@pytest.mark.parametrize("name", ["llama-150m", "llama-500m", "llama-1b", "tiny-llama", "small-llama"])
def test_the_planner_knows_the_scale_presets_as_they_are_built(name):
    """ARCHITECTURES' rows for the scale and random presets are their models' shapes and parameter counts (built on
    the meta device: no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from thinpipe.models.presets import SCALES, scale_config, tiny_config
    from thinpipe.plan.planner import ARCHITECTURES

    config = scale_config(name) if name in SCALES else tiny_config("small" if name == "small-llama" else "llama")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    arch = ARCHITECTURES[name]
    assert (arch.layers, arch.hidden, arch.intermediate, arch.heads, arch.kv_heads, arch.vocab, arch.tied) == (
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_attention_heads,
        config.num_key_value_heads, config.vocab_size, config.tie_word_embeddings)
    assert arch.params == sum(p.numel() for p in model.parameters())
    assert main(["plan", "--set", f"model.name={name}", "--set", "mesh.pp=4", "--set", "link.pp_mbps=200",
                 "--json"]) == 0


def test_a_mixture_of_experts_computes_with_its_active_experts_only():
    """OLMoE-1B-7B: 6.92e9 parameters of which 1.28e9 compute per token (8 of 64 experts); the step's compute is
    6 x active parameters x tokens (issue 53), while DP still carries every parameter."""
    from thinpipe.plan.planner import ARCHITECTURES

    arch = ARCHITECTURES["olmoe-1b-7b"]
    per_layer = sum(r * c for r, c in arch.layer_matrices().values())
    assert per_layer * arch.layers + 2 * arch.vocab * arch.hidden == pytest.approx(arch.params, rel=1e-4)
    assert arch.active_params == pytest.approx(1.282e9, rel=1e-3)
    cfg = load_config(None, ["model.name=olmoe-1b-7b", "mesh.pp=4", "mesh.dp=2", "link.pp_mbps=200",
                             "link.dp_mbps=200", "train.seq_len=512"])
    out = plan(cfg, DEVICES["a100-40gb"])
    device = DEVICES["a100-40gb"]
    S = cfg.train.batch_size * cfg.train.seq_len
    assert out["t_compute_s"] == pytest.approx(cf.t_compute_s(arch.active_params, S, 4, device.peak_flops, device.mfu))
    assert out["params"] == arch.params and out["active_params"] == arch.active_params


def test_a_link_per_boundary_sums_each_boundarys_time():
    """link.pp_mbps as a list: T_PP is each boundary's bytes over its own link (equal lists give the scalar's plan), and
    the schedule simulation waits on the slow link."""
    same = _plan(**{"link__pp_mbps": [200.0] * 7})
    one = _plan()
    assert same["t_pp_s"] == pytest.approx(one["t_pp_s"]) and same["des_pipeline_s"] == pytest.approx(
        one["des_pipeline_s"])
    slow = _plan(**{"link__pp_mbps": [200.0, 200.0, 40.0, 200.0, 200.0, 200.0, 200.0]})
    assert slow["t_pp_s"] == pytest.approx(one["t_pp_s"] * (6 + 5) / 7)  # one boundary 5x slower
    assert slow["des_pipeline_s"] > one["des_pipeline_s"]


def test_uneven_links_get_a_codec_per_boundary_as_a_config_train_takes(tmp_path, capsys):
    """plan --target-tps on uneven links: each boundary the least compression its own link needs (the slow one more),
    printed as a TOML config that loads, and planned again to meet the target."""
    from thinpipe.plan.advice import advise

    cfg = load_config(None, [f"{k}={v}" for k, v in PRESETS["paper-llama1b"].items()] +
                      ["link.pp_mbps=[200, 200, 40, 200, 200, 200, 200]", "dp.kind=diloco"])
    out = advise(cfg, DEVICES["a100-40gb"], target_tps=9000)
    assert out["feasible"] and out["plan"]["tokens_per_s"] >= 9000
    ps = [float(a["arm"].split("=")[1]) for a in out["per_boundary"]]
    assert ps[2] > max(ps[:2] + ps[3:]) and len(set(ps[:2] + ps[3:])) == 1
    (tmp_path / "advice.toml").write_text(out["config_toml"])
    loaded = load_config(tmp_path / "advice.toml")
    assert loaded.boundary.kinds == ["mask"] * 7 and loaded.boundary.p == ps and loaded.link.pp_mbps[2] == 40
    assert main(["plan", "--preset", "paper-llama1b", "--set", "link.pp_mbps=[200, 200, 40, 200, 200, 200, 200]",
                 "--set", "dp.kind=diloco", "--target-tps", "9000"]) == 0
    assert "boundary 2 (40 Mbit/s): mask p=0.95" in capsys.readouterr().out
