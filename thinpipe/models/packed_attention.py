"""Attention over packed documents without a T x T mask (issue 51).

A packed row holds several documents one after another (and padding, one run of its own at the end); a token
attends causally within its document only, and, in a sliding-window layer, to the last ``window`` tokens of it.
The dense path builds that as a (B, 1, T, T) boolean mask (``rank/context.py: dense_mask``): at T = 32k, 1 GiB per
row, and every kernel that takes an arbitrary mask still computes every masked block (or, on the CPU, the whole
T x T score matrix). Here a microbatch's mask is ``Documents``: each row's document spans, found once from its
segment ids. The attention function ``packed_attention`` (registered with transformers as ``thinpipe_packed``,
``ATTENTION``) runs ``scaled_dot_product_attention`` with ``is_causal`` (the fused kernels: flash on a GPU, the
CPU's flash kernel): unpacked rows in one call; packed documents gathered into batches of documents of about one
length (right-padded by at most 25%, which a causal kernel never reads from a real token), so many short documents
cost a few calls; a document longer than a sliding window as query blocks of ``window`` tokens against the keys
they can see (a block x (block + window) mask, never T x T).

What it does not serve, the stage gives the dense mask instead (``Documents.dense``): eager attention (Gemma 2's
attention soft-cap), a tensor mask (KV-cached generation builds its own, ``rank/generation.py``), and
``model.attention = "mask"`` (today's path, for comparison).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

ATTENTION = "thinpipe_packed"


@dataclass(frozen=True)
class Documents:
    """The packed-document causal mask of a microbatch as spans: ``spans[b]`` is row b's ``(start, end)`` runs of
    equal segment id, in order; ``window``: keys fewer than this many positions back (None: the whole document)."""

    spans: tuple[tuple[tuple[int, int], ...], ...]
    length: int
    window: int | None = None
    segment_ids: torch.Tensor | None = field(default=None, compare=False)  # (B, T), for ``dense``

    @classmethod
    def from_segments(cls, segment_ids: torch.Tensor) -> "Documents":
        t, rows = segment_ids.shape[1], []
        for row in segment_ids:  # a run ends where the segment id changes
            edges = [0, *(row[1:] != row[:-1]).nonzero().flatten().add(1).tolist(), t]
            rows.append(tuple(zip(edges[:-1], edges[1:])))
        return cls(tuple(rows), t, None, segment_ids)

    def with_window(self, window: int | None) -> "Documents":
        return replace(self, window=window)

    @property
    def shape(self) -> tuple[int, int, int, int]:  # as the dense mask's, for code that reads a mask's shape
        return (len(self.spans), 1, self.length, self.length)

    def dense(self) -> torch.Tensor:
        """The (B, 1, T, T) boolean mask of the same attention (True = may attend): documents x causal, no window
        (``models/families.py: sliding_window_mask`` adds one)."""
        assert self.segment_ids is not None
        return dense_mask(self.segment_ids)


def dense_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal attention over packed documents as a (B, 1, T, T) boolean mask. Padding (segment -1)
    attends causally among itself so no row of the mask is empty (an empty row gives NaN in SDPA); its labels are
    -100, so it never reaches the loss."""
    t = segment_ids.shape[1]
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    return (same & causal).unsqueeze(1)


def _doc_attention(q, k, v, window: int | None, scaling, dropout: float) -> torch.Tensor:
    """Causal attention of one document's (B, H, L, D) queries, keys and values, within ``window`` positions."""
    n = q.shape[2]
    if window is None or n <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout)
    out = []
    for a in range(0, n, window):  # queries a..a+c see keys from a - window + 1 on
        c = min(window, n - a)
        lo = max(a - window + 1, 0)
        qi = torch.arange(a, a + c, device=q.device).view(c, 1)
        kj = torch.arange(lo, a + c, device=q.device).view(1, a + c - lo)
        mask = (kj <= qi) & (kj > qi - window)
        out.append(F.scaled_dot_product_attention(q[:, :, a:a + c], k[:, :, lo:a + c], v[:, :, lo:a + c],
                                                  attn_mask=mask, scale=scaling, dropout_p=dropout))
    return torch.cat(out, dim=2)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def _bucket(n: int) -> int:
    """The padded length of a document of ``n`` tokens: at most 25% longer, few distinct lengths."""
    if n <= 16:
        return 16
    step = 1 << max((n - 1).bit_length() - 3, 0)
    return -(-n // step) * step


def _batched_causal(q, k, v, docs: list[tuple[int, int, int]], scaling, dropout: float) -> tuple:
    """Causal attention of many documents at once: ``docs`` are (row, start, end), start and end in the queries,
    keys and values flattened to (B x T, H, D); documents of one padded length (``_bucket``) run as one batch.
    Padding goes after a document's last token, where causal attention never looks from a real token, so it changes
    nothing; its outputs are dropped. Returns (the flat positions written, their outputs (N, H, D))."""
    by_len: dict[int, list[tuple[int, int, int]]] = {}
    for d in docs:
        by_len.setdefault(_bucket(d[2] - d[1]), []).append(d)
    where, outs = [], []
    for p, group in by_len.items():
        j = torch.arange(p)
        starts = torch.tensor([s for _, s, _ in group]).view(-1, 1)
        lens = torch.tensor([e - s for _, s, e in group]).view(-1, 1)
        real = j.view(1, -1) < lens
        idx = (starts + torch.minimum(j.view(1, -1), lens - 1)).to(q.device)  # padding repeats the last token
        qd, kd, vd = (x[idx].permute(0, 2, 1, 3) for x in (q, k, v))  # (n, P, H, D) -> (n, H, P, D)
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scaling,
                                           dropout_p=dropout).permute(0, 2, 1, 3)
        real = real.to(q.device)
        where.append(idx[real])
        outs.append(o[real])
    return torch.cat(where), torch.cat(outs)


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function contract: (B, H, T, D) queries, (B, Hkv, T, D) keys and values ->
    ((B, T, H, D) output, None). ``attention_mask`` a ``Documents``: per document (module docstring); anything
    else (a tensor mask, None): transformers' own SDPA function, unchanged."""
    if not isinstance(attention_mask, Documents):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    n_rep = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    docs, window = attention_mask, attention_mask.window
    b, h, t, _ = query.shape
    if all(s == ((0, t),) for s in docs.spans):  # unpacked rows, the common case: one call
        out = _doc_attention(query, key, value, window, scaling, dropout)
        return out.transpose(1, 2).contiguous(), None
    # documents a window does not cut run batched by length; longer ones by query blocks, one at a time
    flat = [x.transpose(1, 2).reshape(b * t, h, x.shape[-1]) for x in (query, key, value)]  # (a value's width may
    #                                                                                          differ from a key's)
    short = [(r, s, e) for r, spans in enumerate(docs.spans) for s, e in spans if window is None or e - s <= window]
    long = [(r, s, e) for r, spans in enumerate(docs.spans) for s, e in spans if window is not None and e - s > window]
    where, outs = [], []
    if short:
        w, o = _batched_causal(*flat, [(r, r * t + s, r * t + e) for r, s, e in short], scaling, dropout)
        where.append(w)
        outs.append(o)
    for r, s, e in long:
        o = _doc_attention(query[r:r + 1, :, s:e], key[r:r + 1, :, s:e], value[r:r + 1, :, s:e], window, scaling,
                           dropout)
        where.append(torch.arange(r * t + s, r * t + e, device=query.device))
        outs.append(o[0].transpose(0, 1))
    values = torch.cat(outs)  # autocast's dtype (bfloat16 from float32 queries)
    out = values.new_zeros(b * t, h, values.shape[-1]).index_put((torch.cat(where),), values)
    return out.view(b, t, h, -1), None


def register() -> None:
    """``thinpipe_packed`` among transformers' attention functions (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)
