"""DPO on the mesh (anchor-priors App. D; Rafailov et al. 2023), one step written once over a ``Pipe``
(``objective/pipe.py``: the simulation's replicas, or one rank of the real mesh).

Rows come in pairs (row 2i chosen, 2i + 1 rejected: ``data/preferences.py``) and a microbatch holds whole
pairs, so each pair's loss is computed where both its sequences are: a sequence's log-prob is the sum over its
completion tokens. The reference log-probs are those of the starting weights, computed once before the first
step through dense boundaries (boundaries that are part of the model stay: they are the model), by the
training forward, and kept in the last stage's checkpoint part, so a resume does not recompute them.
``train.batch_size`` is pairs per step per fast replica; the held-out loss is the DPO loss on held-out pairs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from thinpipe.data.preferences import build_preference_dataset, pair_batches
from thinpipe.objective.data import common_data_args, enough_rows, users_files
from thinpipe.objective.losses import dpo_loss, sequence_logprobs
from thinpipe.objective.pipe import Pipe, chunk_contexts, pack_rows, trim_padding, unpack_rows
from thinpipe.objective.spec import ObjectiveSpec
from thinpipe.rank.from_config import lr_at

STATS = ("pairs", "loss_sum", "margin_sum", "wins", "tokens")


def anchor_loss(cfg):
    """The DPO loss of the anchor's pass (``anchor_rows``): the same loss as an update's, with each sequence's
    reference log-prob carried in its row."""
    beta = cfg.dpo.beta

    def loss(logits, ctx):
        seq, ref = sequence_logprobs(logits, ctx.labels), ctx.extras["ref"].to(logits.device)
        losses, _, _ = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta)
        return losses.sum() * ctx.loss_scale

    return loss


def anchor_contexts(cfg, rows, index, tag, device):
    """The anchor circuit's pass of ``Dpo.anchor_rows``, in whichever process runs it."""
    return unpack_rows(rows, index, tag, device, anchor_loss(cfg))


def anchor_per_row(cfg) -> tuple[str, ...]:
    return ("ref",)


def anchor_max_rows(cfg) -> int:
    return 2 * cfg.train.batch_size  # a replica's pairs of a step, both sequences


def build(cfg, pipe, train_ds, val_ds, tokenizer, bounds_by_replica) -> "Dpo":
    return Dpo(cfg, pipe, train_ds, val_ds)


def data(cfg, tokenizer):
    """(train, held-out) preference pairs from a user's files (``data/preferences.py``: rows 2i and 2i + 1 are
    pair i); ``data.val_rows`` keeps the first held-out pairs."""
    t, d = cfg.train, cfg.data
    name, common = users_files(cfg), common_data_args(cfg)
    train, val = (build_preference_dataset(name, tokenizer, t.seq_len, split, t.seed,
                                           max_examples=(d.max_examples or None) if split == "train" else None,
                                           **common) for split in ("train", "val"))
    if d.val_rows:  # the first pairs: rows 2i and 2i + 1 are pair i
        val.input_ids, val.labels, val.segment_ids = (x[:2 * d.val_rows] for x in
                                                      (val.input_ids, val.labels, val.segment_ids))
    enough_rows(cfg, len(train), t.batch_size * cfg.mesh.dp, "preference pairs",
                "add rows or lower train.batch_size / rl.prompts_per_step")
    return train, val


SPEC = ObjectiveSpec(name="dpo", build=build, data=data, val_key="val_loss", loss_label="DPO loss",
                     val_label="held-out DPO loss (dense)", anchor_contexts=anchor_contexts,
                     anchor_per_row=anchor_per_row, anchor_max_rows=anchor_max_rows)


class Dpo:

    def __init__(self, cfg, pipe: Pipe, train_ds, val_ds):
        self.cfg, self.pipe, self.train_ds, self.val_ds = cfg, pipe, train_ds, val_ds
        self.ref = {"train": torch.zeros(0, 2, dtype=torch.float32), "val": torch.zeros(0, 2, dtype=torch.float32)}
        self._streams: dict[int, Iterator[dict[str, torch.Tensor]]] = {}
        self.last: dict[str, float] = {}
        self._val_metrics: dict[str, float] = {}
        self.tokens = 0  # trained (non-padding) tokens of the whole mesh so far

    @property
    def pairs_per_forward(self) -> int:
        t = self.cfg.train
        return t.batch_size // t.microbatches

    # ------------------------------------------------------------------------- the reference
    def _pass(self, ds, replica: int, loss_fn, step: int) -> list[dict]:
        """Every pair of ``ds`` forward through ``replica``'s pipeline on eval boundaries, one forward at a time
        (nothing of a forward outlives it but what ``loss_fn`` records): each forward's ``stats`` and ``extras``."""
        out = []
        for start in range(0, len(ds), self.pairs_per_forward):
            batch = trim_padding(ds.rows(slice(start, start + self.pairs_per_forward)))
            (c,) = chunk_contexts(batch, batch["input_ids"].shape[0], step, replica, 1.0, device=self.pipe.device)
            c.extras["pair_ids"] = batch["pair_ids"][0::2]
            c.loss_fn = loss_fn
            self.pipe.forward(replica, [c], "eval")
            out.append({"stats": c.stats, "seq": c.extras.get("seq")})
        return out

    def start(self) -> None:
        """The starting weights' sequence log-probs of every training and held-out pair: the replica of this
        process (replica 0 in the simulation, where every replica starts from the same weights)."""
        def record(logits, ctx):
            ctx.extras["seq"] = sequence_logprobs(logits, ctx.labels).detach().float().cpu()
            return logits.new_zeros(())

        r = self.pipe.replicas[0]
        for split, ds in (("train", self.train_ds), ("val", self.val_ds)):
            done = self._pass(ds, r, record, 0)
            if self.pipe.holds_last:
                self.ref[split] = torch.cat([d["seq"].view(-1, 2) for d in done]) if done else torch.zeros(0, 2)

    def residual_batches(self) -> list[dict]:
        """What a data-driven boundary start (outlier channels, MAPL's PCA start) computes on: training pairs."""
        n = self.cfg.train.batch_size
        return [trim_padding(self.train_ds.rows(slice(i * n, (i + 1) * n)))
                for i in range(min(self.cfg.boundary.pca_batches, max(len(self.train_ds) // n, 1)))]

    # ----------------------------------------------------------------------------- a step
    def _loss_fn(self, split: str):
        beta = self.cfg.dpo.beta
        ref_all = self.ref[split]

        def loss(logits, ctx):
            seq = sequence_logprobs(logits, ctx.labels)
            ref = ref_all[ctx.extras["pair_ids"].cpu()].to(seq.device)
            losses, chosen, rejected = dpo_loss(seq[0::2], seq[1::2], ref[:, 0], ref[:, 1], beta)
            ctx.stats.update(pairs=float(losses.numel()), loss_sum=float(losses.detach().sum()),
                             tokens=float(ctx.extras.get("real_tokens", 0)),
                             margin_sum=float((chosen - rejected).sum()), wins=float((chosen > rejected).sum()))
            return losses.sum() * ctx.loss_scale

        return loss

    def restart_streams(self) -> None:
        self._streams = {}

    def step(self, step: int) -> float:
        cfg, pipe = self.cfg, self.pipe
        ctxs: dict[int, list] = {}
        for r in pipe.replicas:
            if r not in self._streams:
                self._streams[r] = pair_batches(self.train_ds, cfg.train.batch_size, cfg.train.seed, shard=r,
                                                num_shards=cfg.mesh.dp, start_step=step)
            batch = trim_padding(next(self._streams[r]))
            rows = chunk_contexts(batch, 2 * self.pairs_per_forward, step, r, 1.0 / cfg.train.batch_size,
                                  device=pipe.device)
            for c, start in zip(rows, range(0, batch["pair_ids"].numel(), 2 * self.pairs_per_forward)):
                c.extras["pair_ids"] = batch["pair_ids"][start:start + 2 * self.pairs_per_forward][0::2]
                rows_of = slice(start, start + 2 * self.pairs_per_forward)
                c.extras["real_tokens"] = int((batch["segment_ids"][rows_of] >= 0).sum())
                c.loss_fn = self._loss_fn("train")
            ctxs[r] = rows
        pipe.update(step, lr_at(cfg, step), ctxs, self)
        total = dict(zip(STATS, pipe.sum_stats(self._sums([c.stats for rows in ctxs.values() for c in rows]))))
        n = max(total["pairs"], 1.0)
        self.tokens += int(total["tokens"])
        self.last = {"dpo_margin": total["margin_sum"] / n, "dpo_accuracy": total["wins"] / n}
        return total["loss_sum"] / n

    anchor_local = False  # the anchor trains on replica 0's pairs of the update: they travel with the pull

    def anchor_rows(self, index, ctxs):
        """Replica 0's pairs of the update and each sequence's reference log-prob (chosen, rejected alternate as
        the rows do; zeros where this process holds no last stage, whose loss alone reads them)."""
        ref = [self.ref["train"][c.extras["pair_ids"].cpu()].reshape(-1) if self.pipe.holds_last else
               torch.zeros(2 * c.extras["pair_ids"].numel()) for c in ctxs[0]]
        return pack_rows(ctxs[0], {"ref": torch.cat(ref).float()})

    def _sums(self, stats: list[dict]) -> list[float]:
        """This process's sums of ``STATS`` over forwards' stats (zeros where it holds no last stage)."""
        if not self.pipe.holds_last:
            return [0.0] * len(STATS)
        return [sum(st.get(k, 0.0) for st in stats) for k in STATS]

    def validation(self) -> float:
        """The DPO loss on the held-out pairs (replica 0; eval boundaries, as the SFT held-out loss)."""
        done = self._pass(self.val_ds, self.pipe.replicas[0], self._loss_fn("val"), 0) if self.pipe.measures else []
        total = dict(zip(STATS, self.pipe.sum_stats(self._sums([d["stats"] for d in done]))))
        n = max(total["pairs"], 1.0)
        # the share of held-out pairs whose chosen answer the policy now prefers more than the reference did
        # (0 at the start through dense boundaries: every margin is exactly 0), as TRL's eval rewards/accuracies
        self._val_metrics = {"val_dpo_accuracy": total["wins"] / n, "val_dpo_margin": total["margin_sum"] / n}
        return total["loss_sum"] / n

    def validation_metrics(self) -> dict:
        return dict(self._val_metrics)

    def metrics(self) -> dict:
        return dict(self.last)

    def state_dict(self) -> dict:
        return {"reference": dict(self.ref), "tokens": self.tokens}

    def load_state_dict(self, state: dict, step: int) -> None:
        self.ref = {k: v.float() for k, v in state["reference"].items()}
        self.tokens = int(state.get("tokens", 0))
        self.restart_streams()
