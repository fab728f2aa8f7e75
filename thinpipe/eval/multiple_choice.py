"""``acc`` / ``acc_norm`` for log-likelihood multiple choice, as lm-evaluation-harness defines them.

lm-eval (``ConfigurableTask.process_results``, output_type ``multiple_choice``)::

    pred      = argmax(lls)
    pred_norm = argmax(lls / completion_len)   # completion_len = [len(choice) for choice in choices]

``len(choice)`` is the length in *characters* of the choice string **without** the target
delimiter (the leading ``" "`` that goes into the scored continuation).  Here the
continuation is ``delimiter + choice``, so the denominator is ``len(continuation) - 1`` when the
continuation starts with a space, else ``len(continuation)``.  Ties go to the lowest index
(``np.argmax``).  Standard errors are lm-eval's ``mean_stderr``: sample std (ddof=1) / sqrt(n).
"""

from __future__ import annotations

import math
from typing import Sequence

from .loglik import LogitsFn, score_requests
from .tasks import MCItem, load_task

__all__ = ["norm_length", "item_predictions", "mc_metrics", "score_items", "evaluate_mc"]


def norm_length(continuation: str) -> int:
    """acc_norm denominator: characters of the choice, i.e. the continuation minus one leading space."""
    n = len(continuation) - 1 if continuation.startswith(" ") else len(continuation)
    return max(n, 1)


def _argmax(xs: Sequence[float]) -> int:
    best = 0
    for i, x in enumerate(xs):
        if x > xs[best]:
            best = i
    return best


def item_predictions(item: MCItem, lls: Sequence[float]) -> tuple[int, int]:
    """(pred, pred_norm) for one item from its per-choice summed log-likelihoods."""
    if len(lls) != item.n_choices:
        raise ValueError(f"{item.id}: {len(lls)} scores for {item.n_choices} choices")
    normed = [ll / norm_length(c) for ll, c in zip(lls, item.continuations)]
    return _argmax(lls), _argmax(normed)


def _mean_stderr(xs: Sequence[float]) -> float:
    n = len(xs)
    if n < 2:
        return float("nan")
    mu = sum(xs) / n
    var = sum((x - mu) ** 2 for x in xs) / (n - 1)
    return math.sqrt(var) / math.sqrt(n)


def mc_metrics(items: Sequence[MCItem], lls: Sequence[Sequence[float]]) -> dict:
    """{"n", "acc", "acc_norm", "acc_stderr", "acc_norm_stderr"} from per-item choice scores."""
    if len(items) != len(lls):
        raise ValueError("one score list per item expected")
    acc, acc_norm = [], []
    for item, s in zip(items, lls):
        pred, pred_norm = item_predictions(item, s)
        acc.append(1.0 if pred == item.gold else 0.0)
        acc_norm.append(1.0 if pred_norm == item.gold else 0.0)
    n = len(items)
    return {
        "n": n,
        "acc": sum(acc) / n if n else float("nan"),
        "acc_norm": sum(acc_norm) / n if n else float("nan"),
        "acc_stderr": _mean_stderr(acc),
        "acc_norm_stderr": _mean_stderr(acc_norm),
    }


def score_items(
    logits_fn: LogitsFn,
    tokenizer,
    items: Sequence[MCItem],
    batch_size: int = 16,
    max_len: int = 2048,
    progress: bool = True,
    **kwargs,
) -> list[list[float]]:
    """Per-item lists of per-choice summed continuation log-likelihoods (one batched pass)."""
    reqs = [r for it in items for r in it.requests()]
    res = score_requests(logits_fn, tokenizer, reqs, batch_size=batch_size, max_len=max_len,
                         progress=progress, **kwargs)
    out, k = [], 0
    for it in items:
        out.append([ll for ll, _ in res[k : k + it.n_choices]])
        k += it.n_choices
    return out


def evaluate_mc(
    logits_fn: LogitsFn,
    tokenizer,
    task: str,
    limit: int | None = None,
    batch_size: int = 16,
    *,
    max_len: int = 2048,
    progress: bool = True,
    add_bos_token: bool | None = False,
) -> dict:
    """Zero-shot lm-eval-style evaluation of ``task`` on its first ``limit`` items.

    Returns ``{"task", "n", "acc", "acc_norm", "acc_stderr", "acc_norm_stderr"}``.
    """
    items = load_task(task, limit)
    lls = score_items(logits_fn, tokenizer, items, batch_size=batch_size, max_len=max_len,
                      progress=progress, add_bos_token=add_bos_token, desc=task)
    return {"task": task, **mc_metrics(items, lls)}
