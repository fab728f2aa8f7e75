"""The tree and its descriptions agree: every path README.md and docs/*.md name exists, and every script
in benchmarks/ and experiments/ still imports after a move.

A path is written from the repository root (``thinpipe/engine/sim_mesh.py``), from the package
(``engine/sim_mesh.py``) or from the folder the text is about (``sim_mesh.py``); each form must name a file
of the repository. References to other projects' files are listed in ``EXTERNAL`` with where they live.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A file path: optional folders, a name, an extension we track. Not preceded by a word, '/', '.' or '-',
# so the tail of a longer path or of a URL is not taken alone, nor by ':' (``git show REV:path``: a file of
# an older tree).
PATH = re.compile(r"(?<![\w/.\-~$:])((?:[\w.\-]+/)*[\w\-]+\.(?:py|sh|md))\b")
EXTERNAL = {
    "torchft/manager.py",             # torchft's Manager (docs/security.md)
    "preprocess_winogrande.py",       # lm-evaluation-harness task helpers (docs/eval.md)
    "medqa/preprocess_medqa.py",
    "hellaswag/utils.py",
    "anchor-priors-masked-pp.md",     # the papers, in ../shared/papers/
    "mapl-learned-subspace-pp.md",
    "dp-algorithms.md",
    "DATA.md",                        # ../shared/DATA.md: the models and data obtainable here
    "my.toml",
}


def repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if (ROOT / f).exists()]


def resolves(ref: str, files: set[str], names: set[str]) -> bool:
    if ref in EXTERNAL or ref.startswith("../"):
        return True
    if "/" not in ref:
        return ref in names
    return ref in files or f"thinpipe/{ref}" in files or any(f.endswith("/" + ref) for f in files)


def stale_references() -> list[str]:
    files = set(repo_files())
    names = {Path(f).name for f in files}
    bad = []
    for doc in DOCS:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                if not resolves(m.group(1), files, names):
                    bad.append(f"{doc.relative_to(ROOT)}:{i}: {m.group(1)}")
    return bad


def test_every_path_the_docs_name_exists():
    bad = stale_references()
    assert not bad, "paths named in the docs that are not in the tree:\n" + "\n".join(bad)


def test_the_check_catches_a_stale_path():
    files = {"thinpipe/engine/sim_mesh.py", "docs/gpu.md"}
    names = {"sim_mesh.py", "gpu.md"}
    assert resolves("engine/sim_mesh.py", files, names) and resolves("thinpipe/engine/sim_mesh.py", files, names)
    assert resolves("sim_mesh.py", files, names)
    assert not resolves("engine/sim.py", files, names) and not resolves("engine/dist_links.py", files, names)
    assert [m.group(1) for m in PATH.finditer("see `engine/sim.py` and https://x.org/a/b.py")] == ["engine/sim.py"]


SCRIPTS = sorted(p for p in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "experiments").rglob("*.py")]
                 if "results" not in p.parts)


# One interpreter imports every script in turn (torch loads once): each runs with its own folder first on
# sys.path, as `python path/to/script.py` would, and the modules its folder provided (run.py, arms.py, ...)
# are forgotten before the next one, whose folder has files of the same names.
IMPORT_ALL = """
import importlib.util, sys, traceback
failed = []
for path in sys.argv[1:]:
    folder = path.rsplit("/", 1)[0]
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location("script_under_test", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except BaseException:
        failed.append(path + ":\\n" + traceback.format_exc(limit=3))
    finally:
        sys.path.remove(folder)
        for name in list(sys.modules):
            where = getattr(sys.modules[name], "__file__", None) or ""
            if "/experiments/" in where or "/benchmarks/" in where:
                del sys.modules[name]
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow  # one process importing ~40 scripts: 4-11 s here, by load
def test_every_script_imports():
    """Importing each script (its ``main`` guarded by ``__name__``) resolves every thinpipe name it uses."""
    r = subprocess.run([sys.executable, "-c", IMPORT_ALL, *map(str, SCRIPTS)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"scripts that do not import:\n{r.stdout[-4000:]}{r.stderr[-2000:]}"


def test_scripts_are_found():
    assert len(SCRIPTS) > 10 and importlib.util.find_spec("thinpipe") is not None
