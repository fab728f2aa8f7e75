"""GSPO with verifiable rewards on the mesh (anchor-priors App. D; Zheng et al. 2025, GSPO), one step written
once over a ``Pipe`` (``objective/pipe.py``: the simulation's replicas, or one rank of the real mesh).

A step, per fast replica: ``rl.prompts_per_step`` prompts from its shard, ``rl.group_size`` rollouts of each
sampled on the mesh from the current weights (through dense boundaries, or the training ones), a math answer
reward plus DAPO's overlong shaping, GRPO advantages (rewards standardised within each group); the old
log-probs recomputed by the training forward (as VeRL does), then ``rl.minibatches`` updates of the clipped
objective, each on its share of the sequences (``objective/losses.py: policy_loss``, seq-mean-token-mean:
each sequence's token mean, summed with weight 1 / sequences of the update; DP averages over replicas).

Exactness the compressed mesh keeps: every forward of a sequence draws its random masks from the PRF keyed by
(seed, boundary, step, sequence) and the token's position (``ctx.row_keys``), never by its microbatch, so the
old-log-prob forward and the first update's forward compute the same numbers and the first log-ratio is exactly
0 for every kind without forward state; a kind whose forward changes its state is refused.
"""

from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from thinpipe.boundary.prf import prf_key
from thinpipe.config import ConfigError
from thinpipe.data.chat import resolve_chat_format, tokenize_messages
from thinpipe.data.loader import derive_seed
from thinpipe.data.prompts import build_prompt_dataset, prompt_batches
from thinpipe.objective.data import common_data_args, enough_rows, users_files
from thinpipe.objective.losses import group_advantages, policy_loss, response_logprobs, token_entropy
from thinpipe.objective.pipe import GENERATE_BATCH, Pipe, chunk_contexts, pack_rows, rollout_rows, unpack_rows
from thinpipe.objective.rewards import math_reward, overlong_penalty
from thinpipe.objective.spec import ObjectiveSpec
from thinpipe.rank.from_config import lr_at
from thinpipe.rank.generation import Sampling

# what the last stages sum over a step, in this order (Pipe.sum_stats)
STATS = ("sequences", "reward_sum", "reward_sq", "correct", "response_tokens", "gen_s", "clipped",
         "tokens", "entropy_sum", "loss_sum", "updates", "trained_tokens", "groups", "zero_std_groups")


def check_rl_boundaries(bounds) -> None:
    """One line for a boundary kind whose forward changes its state (two forwards of a sequence would differ)."""
    for b in bounds:
        if b.forward_state:
            raise ConfigError(f"boundary.kind = {b.kind} changes its state in every forward (so a sequence's "
                              "old-log-prob and update forwards would differ): train.objective = gspo refuses it; "
                              "use another kind (mask, quant4, outlier, mapl, ...) or, for klt, "
                              "boundary.klt_refresh_every = 0")


def stop_ids(tokenizer, chat_format: str) -> list[int]:
    """The tokens a rollout ends at: the tokenizer's EOS and the chat format's end of turn (what SFT trained the
    model to emit after an answer: the first loss token of an empty assistant turn), which differ for some models
    (a base model under ChatML, Gemma's ``<end_of_turn>``)."""
    out = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    fmt = resolve_chat_format(tokenizer, chat_format)
    ids, mask = tokenize_messages(tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
                                  fmt)
    first = next((t for t, m in zip(ids, mask) if m), None)
    return out + ([first] if first is not None and first not in out else [])


def row_keys(step: int, replica: int, n: int) -> torch.Tensor:
    """The PRF key of each of a replica's ``n`` sequences at ``step`` (sequence ids global over replicas)."""
    return torch.tensor([prf_key(step, replica * n + i) for i in range(n)], dtype=torch.int64)


def sampling(cfg, step: int, replica: int, eos_ids: list[int]) -> Sampling:
    """The rollouts' sampling: seeded by (seed, step, replica), so a resumed run draws what it would have."""
    rl = cfg.rl
    return Sampling(max_new_tokens=rl.max_response_tokens, temperature=rl.temperature, top_p=rl.top_p,
                    top_k=rl.top_k, seed=derive_seed(cfg.train.seed, "rollout", step, replica), stop=[],
                    eos_ids=eos_ids)


def rewards_of(texts: list[str], answers: list[str], lengths: list[int], rl) -> tuple[torch.Tensor, torch.Tensor]:
    """(shaped rewards, correctness) of each response: 1 for a correct answer, plus DAPO's overlong shaping."""
    correct = torch.tensor([math_reward(t, a) for t, a in zip(texts, answers)], dtype=torch.float64)
    shaped = torch.tensor([overlong_penalty(n, rl.max_response_tokens, rl.overlong_buffer, rl.overlong_penalty)
                           for n in lengths], dtype=torch.float64)
    return correct + shaped, correct


def anchor_loss(cfg):
    """GSPO's loss on-policy (the anchor's pass of ``Gspo.anchor_rows``): the importance ratio is 1 at the weights
    it computes on (the fast step's snapshot w_t), so its gradient is the one the step's first update estimates
    through the masks."""
    rl = cfg.rl

    def loss(logits, ctx):
        logp, mask = response_logprobs(logits, ctx.labels)
        ref = ctx.extras.get("ref_logp")
        per_seq, _ = policy_loss(logp, logp.detach(), mask, ctx.extras["advantages"].to(logp.device), rl.clip_low,
                                 rl.clip_high, rl.ratio_level, None if ref is None else ref.to(logp.device),
                                 rl.kl_beta)
        return per_seq.sum() * ctx.loss_scale

    return loss


def anchor_contexts(cfg, rows, index, tag, device):
    """The anchor circuit's pass of ``Gspo.anchor_rows``, in whichever process runs it."""
    return unpack_rows(rows, index, tag, device, anchor_loss(cfg))


def anchor_per_row(cfg) -> tuple[str, ...]:
    return ("advantages", "ref_logp") if cfg.rl.kl_beta > 0 else ("advantages",)


def anchor_max_rows(cfg) -> int:
    return cfg.rl.sequences // cfg.rl.minibatches  # a replica's sequences of one update


def build(cfg, pipe, train_ds, val_ds, tokenizer, bounds_by_replica) -> "Gspo":
    return Gspo(cfg, pipe, train_ds, val_ds, tokenizer, bounds_by_replica)


def data(cfg, tokenizer):
    """(train, held-out) prompts with reference answers from a user's files (``data/prompts.py``), each prompt at
    most ``train.seq_len - rl.max_response_tokens`` tokens; ``data.val_rows`` keeps the first held-out prompts."""
    t, d = cfg.train, cfg.data
    name, common = users_files(cfg), common_data_args(cfg)
    room = t.seq_len - cfg.rl.max_response_tokens
    train, val = (build_prompt_dataset(name, tokenizer, split, t.seed,
                                       max_examples=(d.max_examples or None) if split == "train" else None,
                                       max_prompt_tokens=room, **common) for split in ("train", "val"))
    if d.val_rows:
        val.prompts, val.answers, val.texts = val.prompts[:d.val_rows], val.answers[:d.val_rows], \
            val.texts[:d.val_rows]
    enough_rows(cfg, len(train), cfg.rl.prompts_per_step * cfg.mesh.dp, "prompts",
                "add rows or lower train.batch_size / rl.prompts_per_step")
    return train, val


def needs_reference(cfg) -> bool:
    """With a KL to the starting weights every rank keeps a frozen copy of them."""
    return cfg.rl.kl_beta > 0


SPEC = ObjectiveSpec(name="gspo", build=build, data=data, val_key="val_accuracy", val_is_loss=False,
                     loss_label="GSPO loss", val_label="held-out accuracy (greedy)", needs_reference=needs_reference,
                     anchor_contexts=anchor_contexts, anchor_per_row=anchor_per_row, anchor_max_rows=anchor_max_rows)


class Gspo:
    """The GSPO objective of the process driving ``pipe``."""

    def __init__(self, cfg, pipe: Pipe, train_ds, val_ds, tokenizer, bounds_by_replica: list):
        self.cfg, self.pipe, self.train_ds, self.val_ds, self.tokenizer = cfg, pipe, train_ds, val_ds, tokenizer
        # every process derives the same rollouts, rewards and advantages from the sampled tokens; only the last
        # stage scores them (its loss is the only reader) and only it holds log-probs
        for bounds in bounds_by_replica:
            check_rl_boundaries(bounds)
        self.eos_ids = stop_ids(tokenizer, cfg.data.chat_format)
        eos = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
        self._streams: dict[int, object] = {}
        self.last: dict[str, float] = {}
        self.tokens = 0  # trained (non-padding) tokens of the whole mesh so far
        # the largest |log-ratio| of this process's sequences in the step's first update: exactly 0 when the
        # old-log-prob forward and the update forward agree (the tests' check of the masks' keys)
        self.first_update_log_ratio = 0.0

    # ------------------------------------------------------------------------------------ a step
    def _loss_fn(self, which: str):
        rl = self.cfg.rl

        def record_old(logits, ctx):
            ctx.extras["old_logp"] = response_logprobs(logits, ctx.labels)[0].detach()
            return logits.new_zeros(())

        def record_ref(logits, ctx):
            ctx.extras["ref_logp"] = response_logprobs(logits, ctx.labels)[0].detach()
            return logits.new_zeros(())

        def loss(logits, ctx):
            logp, mask = response_logprobs(logits, ctx.labels)
            per_seq, st = policy_loss(logp, ctx.extras["old_logp"], mask, ctx.extras["advantages"], rl.clip_low,
                                      rl.clip_high, rl.ratio_level, ctx.extras.get("ref_logp"), rl.kl_beta)
            ent = token_entropy(logits, ctx.labels)
            ctx.stats.update(clipped=float(st["clipped"]), tokens=float(st["tokens"]),
                             entropy_sum=float(ent[mask].sum()), log_ratio_max=float(st["log_ratio_abs_max"]))
            return per_seq.sum() * ctx.loss_scale

        return {"old": record_old, "ref": record_ref, "update": loss}[which]

    def _texts(self, responses: list[list[int]]) -> list[str]:
        """The responses as text, their stop tokens dropped (what the reward reads)."""
        return [self.tokenizer.decode([t for t in resp if t not in self.eos_ids]) for resp in responses]

    def _stream(self, r: int, step: int):
        if r not in self._streams:
            self._streams[r] = prompt_batches(self.train_ds, self.cfg.rl.prompts_per_step, self.cfg.train.seed,
                                              shard=r, num_shards=self.cfg.mesh.dp, start_step=step)
        return self._streams[r]

    def restart_streams(self) -> None:
        """After a load: the prompt streams restart at the loaded step."""
        self._streams = {}

    def step(self, step: int) -> float:
        cfg, rl, pipe = self.cfg, self.cfg.rl, self.pipe
        n, per_update = rl.sequences, rl.sequences // rl.minibatches
        acc = dict.fromkeys(STATS, 0.0)
        ctxs: dict[int, list] = {}
        for r in pipe.replicas:
            idx = next(self._stream(r, step))
            prompts = [self.train_ds.prompts[i] for i in idx for _ in range(rl.group_size)]
            answers = [self.train_ds.answers[i] for i in idx for _ in range(rl.group_size)]
            keys = row_keys(step, r, n)
            t0 = time.perf_counter()
            responses = pipe.generate(r, prompts, sampling(cfg, step, r, self.eos_ids), rl.rollout_boundaries,
                                      keys if rl.rollout_boundaries == "train" else None, step, "rollout")
            gen_s = time.perf_counter() - t0
            lengths = [len(resp) for resp in responses]
            if pipe.holds_last:  # only the last stage's loss reads them: other ranks skip the scoring
                rewards, correct = rewards_of(self._texts(responses), answers, lengths, rl)
            else:
                rewards = correct = torch.zeros(n, dtype=torch.float64)
            adv = group_advantages(rewards.float(), rl.group_size, rl.scale_rewards)
            batch = rollout_rows(prompts, responses, self.pad_id)
            rows = chunk_contexts(batch, cfg.train.batch_size, step, r, 1.0 / per_update, keys, pipe.device)
            if rl.kl_beta > 0:  # the starting weights' log-probs, for the KL (dense boundaries)
                for c in rows:
                    c.loss_fn = self._loss_fn("ref")
                pipe.forward(r, rows, "reference")
            for c in rows:
                c.loss_fn = self._loss_fn("old")
            pipe.forward(r, rows, "train")  # the old log-probs, by the training forward (last stage)
            for c, sl in zip(rows, range(0, n, cfg.train.batch_size)):
                c.extras["advantages"] = adv[sl:sl + cfg.train.batch_size].to(pipe.device)
                c.loss_fn = self._loss_fn("update")
            ctxs[r] = rows
            if pipe.holds_last:
                acc["sequences"] += n
                acc["reward_sum"] += float(rewards.sum())
                acc["reward_sq"] += float((rewards ** 2).sum())
                acc["correct"] += float(correct.sum())
                acc["response_tokens"] += sum(lengths)
                acc["gen_s"] += gen_s
                acc["trained_tokens"] += int((batch["segment_ids"] >= 0).sum())
                # a group whose rollouts all earn the same reward has zero advantage: it teaches nothing
                acc["groups"] += n // rl.group_size
                acc["zero_std_groups"] += float((rewards.view(-1, rl.group_size).std(dim=1) == 0).sum())
        per = per_update // cfg.train.batch_size
        losses = []
        for m in range(rl.minibatches):
            mine = {r: rows[m * per:(m + 1) * per] for r, rows in ctxs.items()}
            for rows in mine.values():
                for i, c in enumerate(rows):
                    c.microbatch = i  # a worker keys its saved tensors by the microbatch of the update
            losses.append(pipe.update(step * rl.minibatches + m, lr_at(cfg, step), mine, self))
            if pipe.holds_last:
                for rows in mine.values():
                    for c in rows:
                        for k in ("clipped", "tokens", "entropy_sum"):
                            acc[k] += c.stats.get(k, 0.0)
                if m == 0:
                    self.first_update_log_ratio = max(c.stats.get("log_ratio_max", 0.0) for rows in mine.values()
                                                      for c in rows)
        acc["loss_sum"] = sum(losses) if pipe.holds_last else 0.0
        acc["updates"] = float(rl.minibatches * len(pipe.replicas)) if pipe.holds_last else 0.0
        total = dict(zip(STATS, pipe.sum_stats([acc[k] for k in STATS])))
        self.tokens += int(total["trained_tokens"])
        self.last = metrics_of(total)
        return self.last.pop("_loss")

    def start(self) -> None:
        pass

    anchor_local = False  # the anchor trains on replica 0's rollouts of the update: they travel with the pull

    def anchor_rows(self, index, ctxs):
        """Replica 0's rollouts of the update with their advantages (and reference log-probs with the KL; zeros
        where this process holds no last stage, whose loss alone reads them)."""
        rows = ctxs[0]
        per_row = {"advantages": torch.cat([c.extras["advantages"] for c in rows]).float()}
        if self.cfg.rl.kl_beta > 0:  # recorded by the last stage's reference forward alone
            ref = [c.extras["ref_logp"] if self.pipe.holds_last else
                   torch.zeros(c.labels.shape[0], c.labels.shape[1] - 1) for c in rows]
            per_row["ref_logp"] = torch.cat(ref).float()
        return pack_rows(rows, per_row)

    def residual_batches(self) -> list[dict]:
        """What a data-driven boundary start (outlier channels, MAPL's PCA start) computes on: training prompts."""
        n, ds = self.cfg.train.batch_size, self.train_ds
        count = min(self.cfg.boundary.pca_batches, max(len(ds) // n, 1))
        return [rollout_rows(ds.prompts[i * n:(i + 1) * n], [[] for _ in ds.prompts[i * n:(i + 1) * n]], self.pad_id)
                for i in range(count)]

    # ----------------------------------------------------------------------------- held out
    def validation(self) -> float:
        """Greedy accuracy of replica 0 on the held-out prompts (dense boundaries unless part of the model)."""
        ds = self.val_ds
        mine = [0.0, 0.0]
        if self.pipe.measures and len(ds):
            greedy = Sampling(max_new_tokens=self.cfg.rl.max_response_tokens, temperature=0.0, eos_ids=self.eos_ids)
            responses = []
            # hundreds of prompts take minutes on a CPU: a bar on the lead's terminal (none when not a TTY)
            for start in tqdm(range(0, len(ds), GENERATE_BATCH), desc="held-out", unit="batch", leave=False,
                              file=sys.stderr, disable=None if self.pipe.lead else True):
                prompts = list(ds.prompts[start:start + GENERATE_BATCH])
                responses += self.pipe.generate(self.pipe.replicas[0], prompts, greedy, "dense", None, 0, None)
            texts = self._texts(responses)
            if self.pipe.holds_last:
                mine = [sum(math_reward(t, a) for t, a in zip(texts, ds.answers)), float(len(ds))]
        right, n = self.pipe.sum_stats(mine)
        return right / max(n, 1.0)

    def validation_metrics(self) -> dict:
        return {}

    def metrics(self) -> dict:
        return dict(self.last)

    def state_dict(self) -> dict:
        return {"tokens": self.tokens}

    def load_state_dict(self, state: dict, step: int) -> None:
        self.tokens = int(state.get("tokens", 0))
        self.restart_streams()


def metrics_of(t: dict) -> dict:
    """A step's metrics from the summed stats (every replica's sequences weigh alike)."""
    n = max(t["sequences"], 1.0)
    mean = t["reward_sum"] / n
    var = max(t["reward_sq"] / n - mean * mean, 0.0)
    return {"_loss": t["loss_sum"] / max(t["updates"], 1.0) if t["updates"] else 0.0,
            "reward_mean": mean, "reward_std": var ** 0.5, "accuracy": t["correct"] / n,
            "clip_fraction": t["clipped"] / max(t["tokens"], 1.0), "response_len": t["response_tokens"] / n,
            "entropy": t["entropy_sum"] / max(t["tokens"], 1.0),
            "frac_reward_zero_std": t["zero_std_groups"] / max(t["groups"], 1.0),
            "gen_tokens_per_s": t["response_tokens"] / t["gen_s"] if t["gen_s"] > 0 else 0.0}
