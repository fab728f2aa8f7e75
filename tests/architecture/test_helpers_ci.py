"""skip_or_fail: a failed download skips on a developer's machine and fails under CI=true."""

import pytest

from tests.helpers import skip_or_fail


def test_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no PyPI"):
        skip_or_fail("no PyPI")


@pytest.mark.parametrize("ci", [None, "", "false"])
def test_skips_outside_ci(monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="no PyPI"):
        skip_or_fail("no PyPI")
