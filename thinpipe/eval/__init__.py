"""Log-likelihood multiple-choice evaluation with lm-evaluation-harness's zero-shot formats.

>>> from thinpipe.eval.loglik import logits_fn_from_model
>>> from thinpipe.eval.multiple_choice import evaluate_mc
>>> evaluate_mc(logits_fn_from_model(model), tokenizer, "arc_easy", limit=500)  # doctest: +SKIP
{'task': 'arc_easy', 'n': 500, 'acc': ..., 'acc_norm': ..., 'acc_stderr': ..., 'acc_norm_stderr': ...}

See docs/eval.md for each task's prompt format, metric, source and licence.

The package itself imports nothing (the CLI, which needs ``sandbox.SandboxUnavailable``, stays free of torch):
import what you use from its module (``loglik``, ``multiple_choice``, ``tasks``, ``wheels``, ...).
"""
