"""How long the test suite takes from a clean clone (docs/testing.md): ``make test-fast`` and ``make test``.

Clones the committed HEAD of this repository into a temporary folder, builds its ``.venv`` there (``make
setup``, not timed), counts the tests it collects, then times ``make test-fast`` and ``make test`` one after
the other (CI's environment: ``CI=true``), prints a table and writes ``benchmarks/results/test_time.json``
with ``make_test_s``, ``make_test_fast_s``, ``tests`` (collected), ``cores`` and ``commit``. Run it with
nothing else on the machine: the two cores are the measurement.

    .venv/bin/python benchmarks/test_time.py [--out benchmarks/results/test_time.json] [--xdist "-n auto ..."]

``--xdist ""`` measures the suite in one process (the way it ran before pytest-xdist), for the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from thinpipe.provenance import code_stamp

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], cwd: Path, log: Path, env: dict) -> tuple[float, int, str]:
    """(seconds, exit code, output tail) of one command, its output appended to ``log``."""
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - t0
    return seconds, r.returncode, log.read_text()[-2000:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "test_time.json"))
    ap.add_argument("--xdist", default=None, help="the Makefile's XDIST for this measurement (default: its own)")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="thinpipe-test-time-"))
    clone = work / "clone"
    log = work / "log.txt"
    env = {**os.environ, "CI": "true"}
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
        make = ["make"] + ([f"XDIST={args.xdist}"] if args.xdist is not None else [])
        s, rc, tail = run([*make, "setup"], clone, log, env)
        if rc:
            print(tail, file=sys.stderr)
            return 1
        collected = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-m", "pytest", "--collect-only", "-q"],
                                   cwd=clone, env=env, capture_output=True, text=True).stdout
        tests = int(re.search(r"(\d+) tests? collected", collected).group(1))
        fast_s, rc_fast, _ = run([*make, "test-fast"], clone, log, env)
        full_s, rc_full, tail = run([*make, "test"], clone, log, env)
        result = {"make_test_s": round(full_s, 1), "make_test_fast_s": round(fast_s, 1), "tests": tests,
                  "cores": os.cpu_count(), "commit": commit, "xdist": args.xdist if args.xdist is not None else
                  "Makefile default", "make_test_rc": rc_full, "make_test_fast_rc": rc_fast,
                  "summaries": re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", log.read_text(), re.M)}
        print(f"{'command':<16}{'seconds':>9}{'minutes':>9}  exit")
        print(f"{'make test-fast':<16}{fast_s:>9.1f}{fast_s / 60:>9.2f}  {rc_fast}")
        print(f"{'make test':<16}{full_s:>9.1f}{full_s / 60:>9.2f}  {rc_full}")
        print(f"{tests} tests collected, {os.cpu_count()} cores, commit {commit[:10]}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        # the commit measured is the clone's HEAD (``commit`` above); the stamp's is this script's checkout
        Path(args.out).write_text(json.dumps({**code_stamp(), **result}, indent=2) + "\n")
        if rc_fast or rc_full:
            print(tail, file=sys.stderr)
        return 1 if rc_fast or rc_full else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the folder this script made


if __name__ == "__main__":
    sys.exit(main())
