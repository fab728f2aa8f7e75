"""Supervised fine-tuning (and continued pretraining): the next-token loss, one step written once over a ``Pipe``.

A step: each replica this process drives takes its shard's next batch (``rank/from_config.py: replica_stream``),
split into ``train.microbatches`` contexts whose losses sum to the batch's token mean (``rank/context.py``); one
update through the pipe; the training loss is the mean over replicas of their batch losses. The held-out loss is
replica 0's token mean over the held-out rows, through dense boundaries (unless part of the model). The anchor
circuit trains on its own shard of the data (anchor-priors §3: a replica of its own).
"""

from __future__ import annotations

from collections.abc import Iterator

from thinpipe.config import ConfigError
from thinpipe.data import build_dataset
from thinpipe.objective.data import common_data_args
from thinpipe.objective.spec import ObjectiveSpec
from thinpipe.placement import to_device
from thinpipe.rank.context import make_contexts
from thinpipe.rank.from_config import anchor_stream, lr_at, replica_stream, residual_batches, val_batches


def build(cfg, pipe, train_ds, val_ds, tokenizer, bounds_by_replica) -> "Sft":
    return Sft(cfg, pipe, train_ds, val_ds)


def data(cfg, tokenizer):
    """(train, held-out): a corpus or a user's files packed into rows of ``train.seq_len`` tokens
    (``data/loader.py: build_dataset``); ``data.val_rows`` keeps the first held-out rows."""
    t, d = cfg.train, cfg.data
    common = common_data_args(cfg)
    train = build_dataset(d.name, tokenizer, t.seq_len, "train", t.seed, d.max_examples or None, **common)
    val = build_dataset(d.name, tokenizer, t.seq_len, "val", t.seed, **common)
    if len(train) < t.batch_size * cfg.mesh.dp:
        raise ConfigError(f"data {d.name!r} packs into {len(train)} training rows of {t.seq_len} tokens, "
                          "fewer than one "
                          f"step needs ({t.batch_size} x {cfg.mesh.dp} replicas): lower train.batch_size or raise "
                          "data.max_examples")
    if d.val_rows:
        val.input_ids, val.labels, val.segment_ids = (val.input_ids[:d.val_rows], val.labels[:d.val_rows],
                                                      val.segment_ids[:d.val_rows])
    return train, val


def anchor_contexts(cfg, rows, index, tag, device):
    """The anchor circuit's pass of one batch of its shard, in whichever process runs it."""
    return make_contexts(to_device(rows, device), cfg.train.microbatches, index, tag)


def anchor_per_row(cfg) -> tuple[str, ...]:
    return ()


def anchor_max_rows(cfg) -> int:
    return 0  # nothing travels: the anchor reads its own shard


SPEC = ObjectiveSpec(name="sft", build=build, data=data, val_key="val_loss", val_perplexity=True,
                     loss_label="loss (nats/token)", val_label="held-out (unmasked)", anchor_contexts=anchor_contexts,
                     anchor_per_row=anchor_per_row, anchor_max_rows=anchor_max_rows)


class Sft:

    def __init__(self, cfg, pipe, train_ds, val_ds) -> None:
        self.cfg, self.pipe, self.train_ds, self.val_ds = cfg, pipe, train_ds, val_ds
        self.tokens = 0
        self._streams: dict[int, Iterator[dict]] | None = None
        self._anchor = None

    def start(self) -> None:
        pass

    def residual_batches(self) -> list[dict]:
        return residual_batches(self.cfg, self.train_ds)

    def step(self, step: int) -> float:
        cfg, pipe, t = self.cfg, self.pipe, self.cfg.train
        if self._streams is None:  # from the step the run starts (or resumes, or rolls back) at
            self._streams = {r: replica_stream(cfg, self.train_ds, r, step) for r in pipe.replicas}
            self._anchor = anchor_stream(cfg, self.train_ds, step) if cfg.mesh.anchor else None
        ctxs = {r: make_contexts(to_device(next(s), pipe.device), t.microbatches, step, r)
                for r, s in self._streams.items()}
        total = pipe.update(step, lr_at(cfg, step), ctxs, self)
        mine = [total, float(len(ctxs)), float(len(ctxs) * t.batch_size * t.seq_len)] if pipe.holds_last else \
            [0.0, 0.0, 0.0]
        loss_sum, replicas, tokens = pipe.sum_stats(mine)
        self.tokens += int(tokens)
        return loss_sum / replicas

    anchor_local = True  # the anchor reads its own shard: nothing of it crosses a link

    def anchor_rows(self, index, ctxs):
        """The anchor's next batch of its own shard (``rank/from_config.py: anchor_stream``)."""
        return next(self._anchor)

    def validation(self) -> float:
        out = self.pipe.heldout(val_batches(self.val_ds, self.cfg.train.batch_size)) if self.pipe.measures else []
        total, n = self.pipe.sum_stats([sum(s for s, _ in out), float(sum(c for _, c in out))])
        return total / max(n, 1)

    def validation_metrics(self) -> dict:
        return {}

    def metrics(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"tokens": self.tokens}

    def load_state_dict(self, state: dict, step: int) -> None:
        # a checkpoint written before SFT was an objective holds no count: every step trained the same tokens
        t = self.cfg.train
        self.tokens = int(state["tokens"]) if "tokens" in state else step * t.batch_size * t.seq_len * self.cfg.mesh.dp
        self._streams = None
