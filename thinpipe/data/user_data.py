"""A user's files as packed training rows, streamed and cached by content (``data.name`` = a path).

    rows (rows.py) -> split (data.val_name, or a seeded data.val_fraction) -> tokens + loss mask
    (chat.py, data.chat_format) -> best-fit-decreasing packing in windows of WINDOW documents
    (packing.py) -> int32 row files in the cache -> a memory-mapped PackedDataset

Streaming: rows are read one at a time and packed a window at a time, and the packed rows go to disk
as they are made, so a corpus bigger than memory still packs (BFD is exact within a window; a file
of up to WINDOW documents packs exactly as the built-in corpora do). The cache folder is keyed by
the files' content hash, the tokenizer, the chat format and every setting that changes the rows;
it is written to a temporary folder and renamed when complete, so a crash never leaves a half
cache that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from thinpipe.config import ConfigError
from thinpipe.console import say

from .chat import resolve_chat_format, tokenize_messages, tokenize_text
from .fetch import cache_dir
from .packing import PackedDataset, pack
from .rows import DataError, Row, content_hash, data_files, read_rows

WINDOW = 4096        # documents packed together by BFD
CACHE_FORMAT = 1     # bump when the packed rows of the same inputs change
ARRAYS = ("input_ids", "labels", "segment_ids")


def tokenizer_fingerprint(tokenizer) -> str:
    """What a tokenizer maps text to: its serialised vocabulary and rules, specials and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    core = backend.to_str() if backend is not None else f"{type(tokenizer).__module__}.{type(tokenizer).__name__}"
    extra = [getattr(tokenizer, "chat_template", None), getattr(tokenizer, "eos_token_id", None),
             getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "pad_token_id", None)]
    return hashlib.sha256((core + json.dumps(extra, default=str)).encode()).hexdigest()


SPLIT_SEED = 0  # neither the held-out coin nor the held-out rows' order follows train.seed: runs of any seed
               # (and --init-from chains on one file) are scored on the same held-out rows, so their losses pair


def in_val(ordinal: int, fraction: float) -> bool:
    """Row ``ordinal`` of the training files is held out: a fixed per-row coin with P = fraction."""
    d = hashlib.sha256(f"thinpipe-val:{SPLIT_SEED}:{ordinal}".encode()).digest()
    return int.from_bytes(d[:8], "little") / 2**64 < fraction


def _split_rows(path: str, split: str, seed: int, val_name: str, val_fraction: float, skip: bool,
                skipped: list) -> Iterator[Row]:
    if val_name:
        yield from read_rows(val_name, skip, skipped) if split == "val" else read_rows(path, skip, skipped,
                                                                                        exclude=data_files(val_name))
        return
    for k, row in enumerate(read_rows(path, skip, skipped)):
        if in_val(k, val_fraction) == (split == "val"):
            yield row


def _tokenized(rows: Iterator[Row], tokenizer, fmt: str, skip: bool,
               skipped: list) -> Iterator[tuple[list[int], list[bool]]]:
    from jinja2.exceptions import TemplateError

    for row in rows:
        if row.text is not None:
            yield tokenize_text(tokenizer, row.text)
            continue
        try:
            yield tokenize_messages(tokenizer, row.messages, fmt)
        except (TemplateError, ConfigError) as e:  # e.g. Mistral's template refuses a system turn
            err = DataError(f"{row.where}: the model's chat template refuses this conversation ({e}): fix the row, "
                            "set data.chat_format = chatml, or data.skip_bad_rows = true")
            if not skip:
                raise err from None
            skipped.append(str(err))


def _write_packed(docs: Iterator, seq_len: int, pad_id: int, seed: int, folder: Path) -> dict:
    """Pack ``docs`` window by window into int32 row files in ``folder``; the summed packing stats."""
    files = {a: open(folder / f"{a}.bin", "wb") for a in ARRAYS}
    stats = {"num_examples": 0, "num_packed": 0, "num_truncated": 0, "num_dropped_no_loss": 0, "num_rows": 0,
             "num_tokens": 0, "num_loss_tokens": 0}
    window: list = []
    g = torch.Generator().manual_seed(seed)

    def flush() -> None:
        ds = pack(window, seq_len, pad_id, generator=g)
        for a in ARRAYS:
            files[a].write(getattr(ds, a).to(torch.int32).numpy().tobytes())
        for k in stats:
            stats[k] += ds.stats[k]
        window.clear()

    try:
        for doc in docs:
            window.append(doc)
            if len(window) == WINDOW:
                flush()
        if window:
            flush()
    finally:
        for fh in files.values():
            fh.close()
    stats["fill"] = stats["num_tokens"] / (stats["num_rows"] * seq_len) if stats["num_rows"] else 0.0
    return stats


def _complete(folder: Path) -> bool:
    """A cache folder whose row files hold every row its meta.json announces (a power cut after the
    rename could leave a short file: such a cache is rebuilt, never trusted)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        size = meta["stats"]["num_rows"] * meta["seq_len"] * 4
        return all((folder / f"{a}.bin").stat().st_size == size for a in ARRAYS)
    except (OSError, ValueError, KeyError):
        return False


def load_packed(folder: Path) -> PackedDataset:
    """A packed cache as memory-mapped int32 tensors (copy-on-write: nothing writes back to the file)."""
    meta = json.loads((folder / "meta.json").read_text())
    shape = (meta["stats"]["num_rows"], meta["seq_len"])
    arrays = [torch.from_numpy(np.memmap(folder / f"{a}.bin", dtype=np.int32, mode="c", shape=shape))
              if shape[0] else torch.zeros(shape, dtype=torch.int32) for a in ARRAYS]
    return PackedDataset(*arrays, stats=meta["stats"])


def build_file_dataset(path: str, tokenizer, seq_len: int, split: str, seed: int, max_examples: int | None,
                       chat_format: str, val_name: str, val_fraction: float, skip_bad_rows: bool,
                       pad_id: int) -> PackedDataset:
    """The packed rows of one split of a user's files (module doc); cached by content."""
    fmt = resolve_chat_format(tokenizer, chat_format)
    train_files, val_files = data_files(path), data_files(val_name) if val_name else []
    sources = train_files + val_files
    key = hashlib.sha256(json.dumps({
        "format": CACHE_FORMAT, "data": content_hash(train_files),
        "val": content_hash(val_files) if val_name else None, "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_format": fmt, "seq_len": seq_len, "split": split, "seed": seed, "max_examples": max_examples,
        "val_fraction": None if val_name else val_fraction, "split_seed": SPLIT_SEED,
        "skip_bad_rows": skip_bad_rows, "pad": pad_id,
    }).encode()).hexdigest()[:24]
    folder = cache_dir() / "packed" / key
    if _complete(folder):
        return load_packed(folder)
    if folder.exists() and not _complete(folder):  # damaged (checked again: a dist rank may just have finished it)
        shutil.rmtree(folder, ignore_errors=True)
    skipped: list[str] = []
    rows = _split_rows(path, split, seed, val_name, val_fraction, skip_bad_rows, skipped)
    if max_examples:
        rows = (r for k, r in zip(range(max_examples), rows))
    bar = tqdm(rows, desc=f"packing {split} rows of {Path(path).name}", unit=" rows", file=sys.stderr,
               disable=None, leave=False)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        stats = _write_packed(_tokenized(bar, tokenizer, fmt, skip_bad_rows, skipped), seq_len, pad_id, seed, tmp)
        stats.update(source=str(path), split=split, seed=seed, chat_format=fmt, skipped_rows=len(skipped),
                     files=[str(f) for f in sources])
        (tmp / "meta.json").write_text(json.dumps({"seq_len": seq_len, "stats": stats}, indent=1))
        if skipped:
            (tmp / "skipped.txt").write_text("".join(s + "\n" for s in skipped))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process (a dist rank) finished the same cache first
            if not (folder / "meta.json").is_file():
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    if skipped:
        say(f"[thinpipe] data: skipped {len(skipped)} malformed {split} row(s) of {path} (data.skip_bad_rows); "
            f"first: {skipped[0]}; all listed in {folder / 'skipped.txt'}")
    ds = load_packed(folder)
    st = ds.stats
    if st["num_truncated"] or st["num_dropped_no_loss"]:
        say(f"[thinpipe] data: {st['num_truncated']} of {st['num_examples']} {split} documents of {path} are longer "
            f"than train.seq_len = {seq_len} and were cut to it; {st['num_dropped_no_loss']} had no loss token left "
            "and were left out")
    if len(ds) == 0:
        what = ("data.val_fraction held out no rows: raise it or give data.val_name" if split == "val" and not val_name
                else f"no {split} rows with a loss token")
        raise DataError(f"{path}: {what}")
    return ds
