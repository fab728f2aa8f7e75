"""From a corpus name to training batches: build a packed dataset, then iterate it deterministically.

Determinism is what makes resume exact: the batch at step s of shard k depends only on
(seed, s, k, num_shards, batch_size, dataset), never on how many batches this process has already
produced. So a run resumed at `start_step` sees exactly the batches the uninterrupted run would have,
and the checkpoint's whole data position is one integer.

Epoch e uses the permutation randperm(N) drawn from a torch.Generator seeded by (seed, e). Shard k of
K takes the k-th contiguous block of rows_per_shard = N // K rows of that permutation (blocks are
disjoint), and cuts it into steps_per_epoch = rows_per_shard // batch_size batches. The up to
N - K * steps_per_epoch * batch_size left-over rows of an epoch are skipped; a different random
subset each epoch, so no row is skipped systematically. Every shard has the same number of steps
per epoch, so data-parallel replicas stay in lockstep.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from .chat import resolve_chat_format, tokenize_messages
from .corpora import CORPORA, load_examples
from .packing import PackedDataset, pack
from .user_data import SPLIT_SEED, build_file_dataset


def derive_seed(*parts) -> int:
    """A 63-bit seed from a tuple such as (seed, epoch); distinct tuples give independent streams
    (seed * C + epoch arithmetic would collide across (seed, epoch) pairs)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


def build_dataset(name: str, tokenizer, seq_len: int, split: str, seed: int, max_examples: int | None = None,
                  chat_format: str = "auto", val_name: str = "", val_fraction: float = 0.05,
                  skip_bad_rows: bool = False) -> PackedDataset:
    """Examples of corpus `name` (a built-in corpus, or a path to a user's JSONL / Parquet files) ->
    tokens with an assistant-only loss (``chat_format``, chat.py) -> BFD-packed rows.

    Built-in corpora: the examples are shuffled by `seed` before `max_examples` takes the first ones,
    so a small subset is a random sample, not the first subject of the source file. Rows are shuffled
    by `seed` too. The held-out split (``split = "val"``) ignores `seed` and uses ``SPLIT_SEED``: runs
    of every seed are scored on the same rows, so their losses pair (experiments/frontier/README.md:
    paired seeds). A user's files stream through user_data.py (held-out rows from `val_name` or a
    seeded `val_fraction`; `max_examples` takes the first rows). `tokenizer` is an HF tokenizer or a
    ByteTokenizer; padding uses its pad_token_id, or its eos_token_id when it has no pad token.
    """
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = getattr(tokenizer, "eos_token_id", None)
    if pad_id is None:
        raise ValueError("tokenizer has neither pad_token_id nor eos_token_id to pad rows with")
    if max_examples is not None and max_examples <= 0:
        raise ValueError(f"max_examples must be positive or None, got {max_examples}")
    if split == "val":
        seed = SPLIT_SEED
    if name not in CORPORA:
        return build_file_dataset(name, tokenizer, seq_len, split, seed, max_examples, chat_format, val_name,
                                  val_fraction, skip_bad_rows, pad_id)
    fmt = resolve_chat_format(tokenizer, chat_format)
    examples = load_examples(name, split)
    g = _generator(seed, "build_dataset", name, split)
    order = torch.randperm(len(examples), generator=g).tolist()[:max_examples]
    tokenized = [tokenize_messages(tokenizer, ({"role": "user", "content": examples[i]["prompt"]},
                                               {"role": "assistant", "content": examples[i]["response"]}), fmt)
                 for i in order]
    ds = pack(tokenized, seq_len, pad_id, generator=g)
    ds.stats.update(corpus=name, split=split, seed=seed, chat_format=fmt)
    return ds


def steps_per_epoch(num_rows: int, batch_size: int, num_shards: int = 1) -> int:
    """Batches each shard draws per epoch (the same for every shard)."""
    return (num_rows // num_shards) // batch_size


def batches(ds: PackedDataset, batch_size: int, seed: int, shard: int = 0, num_shards: int = 1,
            start_step: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Infinite iterator of {"input_ids", "labels", "segment_ids"}, each (batch_size, seq_len).

    Yields the batches of steps start_step, start_step + 1, ... of shard `shard` (see module doc).
    Arguments are checked here, eagerly, not at the first next().
    """
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"need 0 <= shard < num_shards, got shard={shard}, num_shards={num_shards}")
    if batch_size < 1 or start_step < 0:
        raise ValueError(f"need batch_size >= 1 and start_step >= 0, got {batch_size}, {start_step}")
    spe = steps_per_epoch(len(ds), batch_size, num_shards)
    if spe == 0:
        raise ValueError(f"{len(ds)} rows are too few for {num_shards} shard(s) x batch size {batch_size}")
    return _iterate(ds, batch_size, seed, shard, spe, start_step)


def _iterate(ds: PackedDataset, batch_size: int, seed: int, shard: int, spe: int,
             step: int) -> Iterator[dict[str, torch.Tensor]]:
    block = spe * batch_size  # rows per shard per epoch
    epoch, mine = -1, None
    while True:
        e, j = divmod(step, spe)
        if e != epoch:
            perm = torch.randperm(len(ds), generator=_generator(seed, e))
            epoch, mine = e, perm[shard * block:(shard + 1) * block]
        idx = mine[j * batch_size:(j + 1) * batch_size]
        yield ds.rows(idx)
        step += 1
