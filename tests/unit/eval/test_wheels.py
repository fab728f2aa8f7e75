"""Reading members from a cached wheel (no network): eval shares the data package's downloader."""

import zipfile

from thinpipe.data import fetch as data_fetch
from thinpipe.eval import wheels


def test_reads_member_from_cached_wheel_without_pip(monkeypatch, tmp_path):
    monkeypatch.setenv("THINPIPE_CACHE", str(tmp_path))
    d = tmp_path / "wheels"
    d.mkdir()
    with zipfile.ZipFile(d / "fake_pkg-1.2.3-py3-none-any.whl", "w") as z:
        z.writestr("fake_pkg/data/x.txt", "hello")

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the wheel is cached")

    monkeypatch.setattr(data_fetch.subprocess, "run", no_pip)
    assert wheels.fetch_wheel("fake-pkg", "1.2.3") == d / "fake_pkg-1.2.3-py3-none-any.whl"
    assert wheels.read_member("fake.pkg", "1.2.3", "fake_pkg/data/x.txt") == b"hello"
    assert wheels.list_members("fake_pkg", "1.2.3", "fake_pkg/") == ["fake_pkg/data/x.txt"]


def test_download_failure_is_a_clear_wheel_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("THINPIPE_CACHE", str(tmp_path))

    class Failed:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found for nope==0"

    monkeypatch.setattr(data_fetch.subprocess, "run", lambda *a, **k: Failed())
    try:
        wheels.fetch_wheel("nope", "0")
    except wheels.WheelUnavailable as e:
        assert "nope==0" in str(e) and "No matching distribution" in str(e)
    else:
        raise AssertionError("expected WheelUnavailable")
