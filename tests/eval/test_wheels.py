"""Cache-dir rule and reading members from a cached wheel (no network)."""

import zipfile
from pathlib import Path

from thinpipe.eval import wheels


def test_cache_dir_rule(monkeypatch, tmp_path):
    monkeypatch.setenv("THINPIPE_CACHE", str(tmp_path / "c"))
    assert wheels._cache_dir() == tmp_path / "c"
    monkeypatch.delenv("THINPIPE_CACHE")
    assert wheels._cache_dir() == Path.home() / ".cache" / "thinpipe"


def test_reads_member_from_cached_wheel_without_pip(monkeypatch, tmp_path):
    monkeypatch.setenv("THINPIPE_CACHE", str(tmp_path))
    d = tmp_path / "wheels"
    d.mkdir()
    with zipfile.ZipFile(d / "fake_pkg-1.2.3-py3-none-any.whl", "w") as z:
        z.writestr("fake_pkg/data/x.txt", "hello")

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the wheel is cached")

    monkeypatch.setattr(wheels.subprocess, "run", no_pip)
    assert wheels.fetch_wheel("fake-pkg", "1.2.3") == d / "fake_pkg-1.2.3-py3-none-any.whl"
    assert wheels.read_member("fake.pkg", "1.2.3", "fake_pkg/data/x.txt") == b"hello"
    assert wheels.list_members("fake_pkg", "1.2.3", "fake_pkg/") == ["fake_pkg/data/x.txt"]
