"""Log-likelihood multiple-choice evaluation with lm-evaluation-harness's zero-shot formats.

>>> from thinpipe.eval import evaluate_mc, logits_fn_from_model
>>> evaluate_mc(logits_fn_from_model(model), tokenizer, "arc_easy", limit=500)  # doctest: +SKIP
{'task': 'arc_easy', 'n': 500, 'acc': ..., 'acc_norm': ..., 'acc_stderr': ..., 'acc_norm_stderr': ...}

See docs/eval.md for each task's prompt format, metric, source and licence.
"""

from .loglik import encode_pair, logits_fn_from_model, score_requests
from .multiple_choice import evaluate_mc, item_predictions, mc_metrics, norm_length, score_items
from .tasks import TASKS, MCItem, TaskSpec, load_task
from .wheels import WheelUnavailable

__all__ = [
    "TASKS",
    "MCItem",
    "TaskSpec",
    "load_task",
    "score_requests",
    "encode_pair",
    "logits_fn_from_model",
    "evaluate_mc",
    "score_items",
    "mc_metrics",
    "item_predictions",
    "norm_length",
    "WheelUnavailable",
]
