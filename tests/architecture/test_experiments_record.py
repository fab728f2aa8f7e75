"""experiments/ is a record, not a heap: git tracks no run litter there, and every run summary names its code.

Litter: a run folder's lock (``.thinpipe.lock``), progress logs (``log.txt``, ``*.log``), the job's model a run
writes at its end (``model/``) and per-run loss plots (a ``loss.png`` in a run folder, ``results/<run>/...``; a
study's own figure, such as ``dp_compression/results/loss.png``, stays). .gitignore keeps new ones out; this test
catches a forced add.
Every tracked ``summary.json`` carries ``version`` and ``commit`` (40 hex digits, or "unknown"):
thinpipe/provenance.py writes them, experiments/stamp_summaries.py stamped the older ones from history.
experiments/README.md ("What is committed").
"""

import json
import re
import subprocess
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
COMMIT = re.compile(r"[0-9a-f]{40}|unknown")


def tracked() -> list[PurePosixPath]:
    out = subprocess.run(["git", "ls-files", "--", "experiments"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return [PurePosixPath(p) for p in out.splitlines() if (ROOT / p).exists()]  # a `git rm` not yet committed


def litter(path: PurePosixPath) -> bool:
    """A lock, a progress log, or a loss plot in a run folder (experiments/<study>/results/<run>/...)."""
    if path.name in (".thinpipe.lock", "log.txt") or path.suffix == ".log":
        return True
    if "model" in path.parts[3:-1]:  # the job's model a run writes at its end (OUT/model/): weights, not a result
        return True
    return path.name == "loss.png" and len(path.parts) > 4 and path.parts[2] == "results"


def test_git_tracks_no_run_litter_under_experiments():
    bad = [str(p) for p in tracked() if litter(p)]
    assert not bad, "run litter tracked under experiments/ (git rm it; .gitignore keeps it out):\n" + "\n".join(bad)


def test_every_tracked_summary_names_its_code():
    bad = []
    for p in tracked():
        if p.name == "summary.json":
            s = json.loads((ROOT / p).read_text())
            if not s.get("version") or not COMMIT.fullmatch(str(s.get("commit"))):
                bad.append(str(p))
    assert not bad, ("summaries without version and commit (python experiments/stamp_summaries.py, "
                     "after committing them):\n" + "\n".join(bad))


def test_the_litter_rule_keeps_study_figures():
    assert litter(PurePosixPath("experiments/mapl/results/MAPL_r16/loss.png"))
    assert litter(PurePosixPath("experiments/frontier/results/old_split/Dense_seed_1/loss.png"))
    assert litter(PurePosixPath("experiments/rl/results/runs/sft_Dense/log.txt"))
    assert not litter(PurePosixPath("experiments/dp_compression/results/loss.png"))
    assert not litter(PurePosixPath("experiments/rl/results/gain_curves.png"))


def test_gitignore_keeps_new_litter_out_and_study_figures_in():
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0

    for path in ("experiments/mapl/results/NEW/.thinpipe.lock", "experiments/mapl/results/NEW/log.txt",
                 "experiments/rl/results/runs/NEW/loss.png", "experiments/rl/results/NEW/train.log"):
        assert ignored(path), path
    for path in ("experiments/dp_compression/results/loss.png", "experiments/rl/results/gain_curves.png",
                 "experiments/mapl/results/NEW/summary.json", "experiments/mapl/results/NEW/metrics.jsonl"):
        assert not ignored(path), path
