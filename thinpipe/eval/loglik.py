"""Batched log-likelihood scoring of (context, continuation) requests, lm-eval style.

Reproduces lm-evaluation-harness's ``HFLM.loglikelihood`` for decoder-only models:

* ``_encode_pair``: trailing whitespace of the context moves to the front of the
  continuation; context+continuation is encoded *together* and split at the token length of
  the separately encoded context (purely by position: the continuation is whatever the joint
  encoding holds after the first ``len(context_tokens)`` tokens).  An empty context is
  replaced by the prefix token (BOS, else EOS).
* tokens are encoded with ``add_special_tokens=False`` (lm-eval HFLM's ``add_bos_token=False``,
  its long-standing default for causal models); ``add_bos_token=True`` passes
  ``add_special_tokens=True`` and ``None`` leaves the tokenizer's default, as newer HFLM does.
* the model input is ``(context + continuation)[-(max_len + 1):][:-1]`` (left truncation);
  the continuation's log-probs are read from the last ``len(continuation)`` positions;
  ``is_greedy`` is whether every continuation token is the argmax there.
* requests are sorted longest first, batched with right padding, and results are returned
  in the input order.  Requests with an identical model input (e.g. single-token letter
  choices sharing a context, like lm-eval's one-token cache) share one forward row.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["LogitsFn", "encode_pair", "score_requests", "score_token_pairs", "logits_fn_from_model"]

LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _encode(tokenizer, text: str, add_special_tokens: bool | None) -> list[int]:
    if add_special_tokens is None:  # the tokenizer's own default (newer lm-eval, add_bos_token=None)
        return list(tokenizer.encode(text))
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _prefix_token_id(tokenizer) -> int:
    for attr in ("bos_token_id", "eos_token_id"):
        tid = getattr(tokenizer, attr, None)
        if tid is not None:
            return int(tid)
    raise ValueError("empty context needs a tokenizer with a bos_token_id or eos_token_id")


def encode_pair(
    tokenizer, context: str, continuation: str, add_bos_token: bool | None = False
) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation) exactly as lm-eval's HFLM computes them.

    ``add_bos_token`` is passed to ``tokenizer.encode`` as ``add_special_tokens`` (False: the
    long-standing lm-eval HFLM default; None: the tokenizer's own default, as recent HFLM releases do).
    """
    if context == "":
        return [_prefix_token_id(tokenizer)], _encode(tokenizer, continuation, add_bos_token)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
        if context == "":  # whitespace-only context: nothing left to condition on
            return [_prefix_token_id(tokenizer)], _encode(tokenizer, continuation, add_bos_token)
    whole = _encode(tokenizer, context + continuation, add_bos_token)
    ctx = _encode(tokenizer, context, add_bos_token)
    return ctx, whole[len(ctx):]


def logits_fn_from_model(model: torch.nn.Module) -> LogitsFn:
    """``logits_fn`` for a Hugging Face causal LM (``model(input_ids, attention_mask).logits``)."""

    device = next(model.parameters()).device

    def fn(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits

    return fn


def score_requests(
    logits_fn: LogitsFn,
    tokenizer,
    requests: Sequence[tuple[str, str]],
    batch_size: int = 16,
    max_len: int = 2048,
    progress: bool = True,
    *,
    add_bos_token: bool | None = False,
    pad_token_id: int = 0,
    device: torch.device | str | None = None,
    desc: str = "loglikelihood",
) -> list[tuple[float, bool]]:
    """(sum of continuation log-probs, is_greedy) for each (context, continuation) request.

    ``logits_fn(input_ids (B, T), attention_mask (B, T)) -> logits (B, T, V)`` gets right-padded
    batches (padding positions have mask 0 and token ``pad_token_id``; their logits are never
    read).  Contexts longer than ``max_len`` tokens are truncated on the left.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if max_len < 1:
        raise ValueError("max_len must be >= 1")

    pairs = [encode_pair(tokenizer, ctx, cont, add_bos_token) for ctx, cont in requests]
    for (ctx, cont), (_, k_ids) in zip(requests, pairs):
        if not k_ids:
            raise ValueError(f"continuation {cont!r} encodes to no tokens (context {ctx[-40:]!r})")
    return score_token_pairs(logits_fn, pairs, batch_size, max_len, progress, pad_token_id=pad_token_id,
                             device=device, desc=desc)


def score_token_pairs(
    logits_fn: LogitsFn,
    pairs: Sequence[tuple[list[int], list[int]]],
    batch_size: int = 16,
    max_len: int = 2048,
    progress: bool = True,
    *,
    pad_token_id: int = 0,
    device: torch.device | str | None = None,
    desc: str = "loglikelihood",
) -> list[tuple[float, bool]]:
    """(sum of continuation log-probs, is_greedy) for each (context ids, continuation ids) pair: what
    ``score_requests`` does after tokenizing, and lm-eval's ``_loglikelihood_tokens`` (``eval/harness.py``)."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if max_len < 1:
        raise ValueError("max_len must be >= 1")
    # 1. the model input of request k is inps[k], its scored targets conts[k].
    inps: list[tuple[int, ...]] = []
    conts: list[list[int]] = []
    for c_ids, k_ids in pairs:
        if not k_ids:
            raise ValueError("a continuation of no tokens has no log-likelihood")
        if len(k_ids) > max_len:
            raise ValueError(f"continuation of {len(k_ids)} tokens exceeds max_len={max_len}")
        full = (list(c_ids) + list(k_ids))[-(max_len + 1):][:-1]
        inps.append(tuple(full))
        conts.append(list(k_ids))

    # 2. unique model inputs, longest first (ties broken by tokens, as lm-eval's collator).
    uniq: dict[tuple[int, ...], list[int]] = {}
    for k, inp in enumerate(inps):
        uniq.setdefault(inp, []).append(k)
    order = sorted(uniq, key=lambda t: (-len(t), t))

    results: list[tuple[float, bool] | None] = [None] * len(pairs)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(pairs), desc=desc, unit="req", dynamic_ncols=True)
    try:
        with torch.inference_mode():
            for b0 in range(0, len(order), batch_size):
                batch = order[b0 : b0 + batch_size]
                T = len(batch[0])
                ids = torch.full((len(batch), T), pad_token_id, dtype=torch.long)
                mask = torch.zeros((len(batch), T), dtype=torch.long)
                for r, inp in enumerate(batch):
                    ids[r, : len(inp)] = torch.tensor(inp, dtype=torch.long)
                    mask[r, : len(inp)] = 1
                if device is not None:
                    ids, mask = ids.to(device), mask.to(device)
                logits = logits_fn(ids, mask)
                if logits.dim() != 3 or logits.shape[:2] != ids.shape:
                    raise ValueError(
                        f"logits_fn returned shape {tuple(logits.shape)} for input {tuple(ids.shape)}"
                    )
                done = 0
                for r, inp in enumerate(batch):
                    n = len(inp)
                    for k in uniq[inp]:
                        cont = conts[k]
                        window = logits[r, n - len(cont) : n].float().log_softmax(dim=-1)
                        target = torch.tensor(cont, dtype=torch.long, device=window.device)
                        lp = window.gather(-1, target[:, None]).squeeze(-1)
                        greedy = bool((window.argmax(dim=-1) == target).all())
                        results[k] = (float(lp.sum()), greedy)
                        done += 1
                del logits
                if bar is not None:
                    bar.update(done)
    finally:
        if bar is not None:
            bar.close()
    return results  # type: ignore[return-value]
