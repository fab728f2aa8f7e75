"""Batched sampling from a model split over pipeline stages, with a KV cache per stage: one rank's part.

Written once for both engines, as the held-out pass (``rank/passes.py``): every rank of one replica
runs ``decode_pass`` with the same prompts; the simulation drives them in lockstep over its mailbox
(``engine/sim_generate.py``), a real rank iterates its own over a ``DistTransport``
(``engine/dist_generate.py``).

- **Left padding**, as Hugging Face ``generate`` does: prompts end in the same column, positions are
  the cumulative count of real tokens - 1, and a row's pads attend to each other only (every row
  of the (B, 1, q, kv) mask holds a True, so no softmax row is empty; real tokens never see a pad).
- **Prefill, then one decode step per round.** Each stage keeps the keys and values of its own
  layers (``StageCache``); a decode step sends one token's activation per sequence across each
  boundary, through the boundary's codec (``sender_forward`` / ``receiver_forward``: a learned
  boundary reads the tokens of the step from ``ctx.input_ids``).
- **The last stage samples** from the last position's logits: temperature, then top-k, then top-p
  (Hugging Face's ``TopKLogitsWarper`` and ``TopPLogitsWarper``: Fan et al. 2018's top-k, Holtzman
  et al. 2020's nucleus), each sequence drawing from its own CPU ``torch.Generator`` seeded by
  (``Sampling.seed``, its index in the whole prompt list), so a sequence's draws depend neither on the
  batch it is cut into nor on which rows finished (two copies of one prompt sample independently);
  temperature 0 is greedy (argmax). It sends the sampled tokens and per-row done flags (int64) to every other
  stage of the replica, so stage 0 embeds them next round and all stages stop in the same round.
- **Done**: an EOS id was sampled (kept in the output), a stop string appears in the decoded
  completion, or ``max_new_tokens``. Finished rows leave the batch (every stage drops the same rows
  from its cache, known from the done flags), so they neither grow nor cost compute.

Receivers bound what they accept (docs/security.md): activations by the boundary's
``payload_expect("fwd", tokens)``, the token message exactly (two int64 vectors, one entry per
live row), its values checked before use.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from thinpipe.boundary.link import receiver_forward, sender_forward
from thinpipe.comm.header import Expect, PayloadError
from thinpipe.comm.payload import Payload
from thinpipe.comm.protocols import Transport
from thinpipe.comm.tags import EvalActivation, SampledTokens
from thinpipe.comm.work import DONE
from thinpipe.config import ConfigError
from thinpipe.data.loader import derive_seed
from thinpipe.eval.generative import truncate_at_stop
from thinpipe.models.packed_attention import Documents
from thinpipe.placement import autocast, device_of
from thinpipe.rank.context import MicrobatchContext
from thinpipe.rank.passes import eval_boundary


@dataclass
class Sampling:
    """How to sample a completion. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    eos_ids: list[int] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> Sampling:
        """Itself, or a one-line ConfigError naming the bad field and its range."""
        def bad(what: str) -> ConfigError:
            return ConfigError(f"sampling: {what}")

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise bad(f"seed must be an integer >= 0, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.eos_ids):
            raise bad(f"eos_ids must be token ids (integers >= 0), got {self.eos_ids!r}")
        return self


# ------------------------------------------------------------------------------ sampling math

def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits outside each row's k largest set to -inf (``TopKLogitsWarper``; ties at the k-th kept)."""
    if k <= 0:
        return logits
    kth = torch.topk(logits, min(k, logits.shape[-1]))[0][..., -1:]
    return logits.masked_fill(logits < kth, -math.inf)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter (``TopPLogitsWarper``): drop the least likely tokens whose cumulative probability
    is <= 1 - p, always keeping the most likely one."""
    if p >= 1:
        return logits
    ordered, order = torch.sort(logits, descending=False, dim=-1)
    drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - p
    drop[..., -1:] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)


def next_tokens(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator]) -> torch.Tensor:
    """(B,) tokens from (B, V) logits: argmax at temperature 0, else row i's draw with ``generators[i]``
    from softmax(top_p(top_k(logits / temperature))), on the CPU (the same draws whatever the device)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    x = top_p_filter(top_k_filter(logits.float() / sampling.temperature, sampling.top_k), sampling.top_p)
    probs = x.softmax(dim=-1).cpu()
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)]).to(logits.device)


def row_generators(seed: int, first_row: int, rows: int) -> list[torch.Generator]:
    """One generator per sequence, seeded by (seed, the sequence's index in the whole prompt list)."""
    return [torch.Generator().manual_seed(derive_seed("sample", seed, first_row + i)) for i in range(rows)]


# ------------------------------------------------------------------------------ the batch

def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T), real (B, T) bool): prompts right-aligned, ``pad_id`` before them."""
    if any(len(p) == 0 for p in prompts):
        raise ConfigError(f"prompt {[len(p) for p in prompts].index(0)} of the batch is empty: give every prompt "
                          "at least one token")
    t = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t), pad_id, dtype=torch.long)
    real = torch.zeros(len(prompts), t, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = torch.tensor(p, dtype=torch.long)
        real[i, t - len(p):] = True
    return ids.to(device), real.to(device)


def prefill_positions(real: torch.Tensor) -> torch.Tensor:
    """Positions as Hugging Face ``generate`` gives them: cumsum(mask) - 1, pads at 1 (they feed nothing)."""
    return (real.long().cumsum(-1) - 1).masked_fill(~real, 1)


class StageCache:
    """Keys and values of one stage's layers, the ``past_key_values`` Hugging Face attention extends
    (``update(k, v, layer_idx)``; each layer carries its global number). Buffers hold ``capacity``
    positions from the first update, so a decode step writes one column instead of copying the cache."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.used: dict[int, int] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx not in self.keys:
            b, h, _, d = key.shape
            self.keys[layer_idx] = key.new_empty(b, h, self.capacity, d)
            self.values[layer_idx] = value.new_empty(b, h, self.capacity, value.shape[-1])
            self.used[layer_idx] = 0
        n, q = self.used[layer_idx], key.shape[2]
        if n + q > self.capacity:
            raise RuntimeError(f"layer {layer_idx}: the cache holds {self.capacity} positions, {n + q} were written")
        self.keys[layer_idx][:, :, n:n + q] = key
        self.values[layer_idx][:, :, n:n + q] = value
        self.used[layer_idx] = n + q
        return self.keys[layer_idx][:, :, :n + q], self.values[layer_idx][:, :, :n + q]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Only the sequences ``rows`` (indices into the batch) go on."""
        for store in (self.keys, self.values):
            for i, t in store.items():
                store[i] = t.index_select(0, rows)


def token_expect(rows: int) -> Expect:
    """The token message of a round with ``rows`` live sequences, exactly."""
    return Expect.exactly({"tokens": ((rows,), torch.int64), "done": ((rows,), torch.int64)})


def check_token_message(payload: Payload, vocab: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, done bool) of a received token message whose values are what a sampler can send."""
    tok, done = payload.tensors["tokens"], payload.tensors["done"]
    if bool((tok < 0).any()) or (vocab is not None and bool((tok >= vocab).any())):
        raise PayloadError(f"a token message holds ids outside [0, {vocab or 'vocabulary'}): refused")
    if bool(((done != 0) & (done != 1)).any()):
        raise PayloadError("a token message holds done flags other than 0 / 1: refused")
    return tok, done.bool()


def _row_done(tokens: list[int], tok: int, sampling: Sampling, tokenizer) -> bool:
    if tok in sampling.eos_ids:
        return True
    return bool(sampling.stop) and any(s in tokenizer.decode(tokens + [tok]) for s in sampling.stop)


# ------------------------------------------------------------------------------ one rank's pass

@torch.no_grad()
def decode_pass(stage, in_b, out_b, transport: Transport, prompts: list[list[int]], sampling: Sampling, tokenizer,
                pad_id: int, out: list, *, replica: int = 0, key=0, axis: str | None = None,
                compute_dtype: torch.dtype = torch.float32, row_keys: torch.Tensor | None = None,
                step: int = 0, first_row: int = 0) -> Generator:
    """``replica``'s rank of ``stage`` generates completions of ``prompts`` (token ids) with the other
    ranks of the replica, through ``in_b`` / ``out_b`` (the caller picks them: ``passes.eval_boundary``
    or the training boundaries). Afterwards ``out`` holds, per prompt, its generated ids (EOS included
    when sampled), on every rank. Yields ``DONE`` once per round; payloads are metered on ``axis``.
    ``first_row``: the index of ``prompts[0]`` in the caller's whole list (it seeds the rows' draws)."""
    sampling.validate()
    out[:] = [[] for _ in prompts]
    if not prompts:
        transport.flush()
        return
    dev, s, last = device_of(stage), stage.index, stage.is_last
    ids, real = left_pad(prompts, pad_id, dev)
    live = list(range(len(prompts)))                 # prompt index of each row still generating
    keys = None if row_keys is None else row_keys.to(dev)
    n_real = real.sum(dim=1)                         # real tokens per row: the next token's position
    cache = StageCache(ids.shape[1] + sampling.max_new_tokens)
    gens = row_generators(sampling.seed, first_row, len(prompts)) if last and not sampling.greedy else []
    # every stage checks a peer's token ids against the model's vocabulary before using them (stage 0 embeds
    # them; a learned boundary's sender indexes its token tables with them): the rotary module holds the config
    vocab = stage.embed_tokens.num_embeddings if stage.is_first else stage.rotary_emb.config.vocab_size
    # the prefill's mask as the prompts' spans, pads segment -1 and real tokens 0 (models/packed_attention.py: no
    # T x T mask at a long prompt; a stage that cannot use them takes their dense form: causal, real tokens attend
    # to real tokens only, pads to pads); each decode step's is one row of columns
    x_ids, pos = ids, prefill_positions(real)
    mask: Documents | torch.Tensor = Documents.from_segments(torch.where(real, 0, -1))
    for r in range(sampling.max_new_tokens):
        ctx = MicrobatchContext(step, 0, replica, x_ids, torch.full_like(x_ids, -100), pos, mask, 1.0,
                                row_keys=keys)
        tag = ("gen", key, r)
        if stage.is_first:
            x = x_ids
        else:
            payload = transport.recv(EvalActivation(replica, s - 1, tag), in_b.payload_expect("fwd", ctx.tokens, ctx))
            x = receiver_forward(in_b, payload, ctx, torch.float32)[1]
        with autocast(dev, compute_dtype):
            h = stage.hidden_states(x, ctx, cache)
            logits = stage.logits(h[:, -1]).float() if last else None
        if not last:
            transport.send(EvalActivation(replica, s, tag), sender_forward(out_b, h, ctx)[1], axis)
        else:
            assert logits is not None  # the last stage computed them above
            tok = next_tokens(logits, sampling, gens)
            final = r == sampling.max_new_tokens - 1
            done = torch.tensor([final or _row_done(out[i], t, sampling, tokenizer)
                                 for i, t in zip(live, tok.tolist())], dtype=torch.int64, device=dev)
            message = Payload({"tokens": tok.long(), "done": done})
            for other in range(stage.num_stages - 1):
                transport.send(SampledTokens(replica, other, tag), message, axis)
            done = done.bool()
        yield DONE
        if not last:
            tok, done = check_token_message(
                transport.recv(SampledTokens(replica, s, tag), token_expect(len(live))), vocab)
        for i, t in zip(live, tok.tolist()):
            out[i].append(t)
        if bool(done.all()):
            break
        go = (~done).nonzero()[:, 0]
        if len(go) < len(live):                      # finished rows leave the batch on every stage alike
            live = [live[i] for i in go.tolist()]
            gens = [gens[i] for i in go.tolist()] if gens else gens
            cache.keep_rows(go)
            real, n_real, tok = real[go], n_real[go], tok[go]
            keys = None if keys is None else keys[go]
        x_ids, pos = tok.view(-1, 1).long(), n_real.view(-1, 1)
        n_real = n_real + 1
        real = torch.cat([real, torch.ones_like(real[:, :1])], dim=1)
        mask = real[:, None, None, :]
    transport.flush()


def truncate_completion(tokens: list[int], tokenizer, sampling: Sampling) -> str:
    """The completion's text: a final EOS dropped, cut at the first stop string."""
    if tokens and tokens[-1] in sampling.eos_ids:
        tokens = tokens[:-1]
    return truncate_at_stop(tokenizer.decode(tokens), sampling.stop)


def finish_reason(tokens: list[int], tokenizer, sampling: Sampling) -> str:
    """Why a completion ended: ``eos``, ``stop`` (a stop string) or ``length`` (max_new_tokens)."""
    if tokens and tokens[-1] in sampling.eos_ids:
        return "eos"
    text = tokenizer.decode(tokens)
    return "stop" if any(s in text for s in sampling.stop) else "length"


def pad_id_of(tokenizer, sampling: Sampling) -> int:
    """The id left padding uses (never attended to; any valid id does): the tokenizer's pad, else an EOS, else 0."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = sampling.eos_ids[0] if sampling.eos_ids else getattr(tokenizer, "eos_token_id", None)
    return int(pad) if pad is not None else 0


BOUNDARY_CHOICES = ("dense", "train")


def pick_boundary(b, boundaries: str):
    """The boundary a generation pass goes through, for ``boundaries`` = dense | train."""
    if boundaries not in BOUNDARY_CHOICES:
        raise ConfigError(f"boundaries must be one of {', '.join(BOUNDARY_CHOICES)}, got {boundaries!r}")
    if b is None:
        return None
    return eval_boundary(b) if boundaries == "dense" else b


def chunks(n: int, batch_size: int | None) -> list[slice]:
    """Slices of ``n`` prompts, at most ``batch_size`` each (None: one)."""
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    size = n if batch_size is None else batch_size
    return [slice(i, i + size) for i in range(0, n, max(size, 1))]
