"""The test-time budget (docs/testing.md): a test marked neither ``slow`` nor ``dist`` runs in ``make test-fast``,
the inner loop, and must stay fast. One that takes longer than ``THINPIPE_FAST_TEST_BUDGET_S`` (default 8 s,
its setup and call together) fails with a line that says so and what to do: make it cheaper (tiny models,
fewer steps, a shared fixture) or mark it ``slow``. Under pytest-xdist each worker computes on one thread,
so that two workers share the two cores instead of fighting over them."""

from __future__ import annotations

import os

import pytest
import torch

FAST_BUDGET_S = float(os.environ.get("THINPIPE_FAST_TEST_BUDGET_S", "8"))
_SPENT = pytest.StashKey[float]()  # a test's setup + call seconds so far

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    # Native thread pools that outlive the test that started them stay in the worker for every later test file:
    # tokenizers' Rust pool (a BPE trained by a test) and Arrow's (datasets, lm-eval). Twice a worker aborted
    # natively in a later file's torch.cdist ("Fatal Python error: Aborted" from a thread with no Python frame),
    # each time after a file that trained a BPE: one thread each, set before any of them starts.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def one_thread():
    """The ranks of a dist test run with OMP_NUM_THREADS=1; a simulation it is compared with bitwise must split its
    reductions (LAPACK's SVD in the spectral filter, say) the same way."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def is_fast(item) -> bool:
    return item.get_closest_marker("slow") is None and item.get_closest_marker("dist") is None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when in ("setup", "call"):
        item.stash[_SPENT] = item.stash.get(_SPENT, 0.0) + call.duration
    if call.when != "call" or not report.passed or FAST_BUDGET_S <= 0 or not is_fast(item):
        return
    spent = item.stash[_SPENT]
    if spent > FAST_BUDGET_S:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {spent:.1f} s (setup + call) in the fast set, over its budget of "
                           f"{FAST_BUDGET_S:g} s (THINPIPE_FAST_TEST_BUDGET_S): make it cheaper (a tiny model, fewer "
                           "steps, a shared fixture) or mark it slow (docs/testing.md)")

