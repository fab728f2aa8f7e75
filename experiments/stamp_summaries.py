"""Stamp the committed run summaries under experiments/ that predate the code stamp, from git history.

A ``summary.json`` written today carries ``version`` and ``commit`` (thinpipe/provenance.py). The ones
committed before that record no code; the closest honest stamp is the code as it stood when the result
was committed: ``commit`` = the parent of the last commit that changed the file (for most, the commit
that added it; a few were rerun and recommitted, and the numbers standing are the rerun's), ``version``
= pyproject.toml's version at that parent, and ``commit_source`` saying so. A summary that already has a
``commit`` is left alone, so the script can be rerun. Only keys are added: the file is rewritten only if
its text reads back unchanged but for them.

    python experiments/stamp_summaries.py            # stamp what is unstamped
    python experiments/stamp_summaries.py --check    # list the unstamped ones; exit 1 if any
"""

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "parent of the last commit that changed this file before it was stamped (stamped afterwards)"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def tracked_summaries() -> list[Path]:
    return [ROOT / p for p in git("ls-files", "--", "experiments").splitlines() if p.endswith("/summary.json")]


def stamp_from_history(path: Path) -> dict:
    rel = str(path.relative_to(ROOT))
    if git("status", "--porcelain", "--", rel).strip():
        raise SystemExit(f"{rel} differs from the last commit: commit it, then stamp it")
    changed = git("log", "-1", "--format=%H", "--", rel).strip()
    if not changed:
        raise SystemExit(f"{rel} has no commit yet: commit it, then stamp it")
    parent = git("rev-parse", f"{changed}^").strip()
    version = tomllib.loads(git("show", f"{parent}:pyproject.toml"))["project"]["version"]
    return {"version": version, "commit": parent, "commit_source": SOURCE}


def stamp(path: Path) -> None:
    text = path.read_text()
    summary = json.loads(text)
    if json.dumps(summary, indent=2) != text.rstrip("\n"):
        raise SystemExit(f"{path.relative_to(ROOT)} does not read back as written: stamp it by hand")
    summary.update(stamp_from_history(path))
    path.write_text(json.dumps(summary, indent=2) + text[len(text.rstrip("\n")):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only list the unstamped summaries")
    args = ap.parse_args()
    todo = [p for p in tracked_summaries() if "commit" not in json.loads(p.read_text())]
    for p in todo:
        if args.check:
            print(f"unstamped: {p.relative_to(ROOT)}")
        else:
            stamp(p)
    print(f"{len(todo)} summaries {'unstamped' if args.check else 'stamped'}")
    return 1 if args.check and todo else 0


if __name__ == "__main__":
    sys.exit(main())
