"""thinpipe/provenance.py: the code stamp of a result names the checkout's HEAD, or "unknown" outside git."""

import shutil
import subprocess
from pathlib import Path

import pytest

import thinpipe
from thinpipe.provenance import PACKAGE, code_stamp


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_in_this_checkout_the_commit_is_head():
    if subprocess.run(["git", "-C", str(PACKAGE), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("the source tree is not a git checkout")
    stamp = code_stamp()
    assert stamp["version"] == thinpipe.__version__
    assert stamp["commit"] == _git(PACKAGE, "rev-parse", "HEAD")
    assert len(stamp["commit"]) == 40 and isinstance(stamp["dirty"], bool)
    stamp["commit"] = "changed"  # a fresh dict each call: a caller's edit does not reach the cache
    assert code_stamp()["commit"] != "changed"


def test_a_copy_outside_git_is_unknown(tmp_path):
    copy = tmp_path / "thinpipe"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert code_stamp(copy) == {"version": thinpipe.__version__, "commit": "unknown", "dirty": None}


def test_a_package_git_does_not_track_is_unknown_though_it_lies_in_a_checkout(tmp_path):
    """A virtual environment inside a checkout (site-packages/thinpipe, untracked) must not borrow its commit."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "README").write_text("x")
    _git(tmp_path, "add", "README")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    pkg = tmp_path / "venv" / "thinpipe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    assert code_stamp(pkg)["commit"] == "unknown"
    src = tmp_path / "src" / "thinpipe"  # the same package, tracked: the checkout's HEAD
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    _git(tmp_path, "add", "src")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "y")
    assert code_stamp(src) == {"version": thinpipe.__version__, "commit": _git(tmp_path, "rev-parse", "HEAD"),
                               "dirty": False}
