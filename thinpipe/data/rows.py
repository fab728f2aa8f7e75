"""A user's training data from files: JSONL or Parquet, one file or a folder of them, read as a stream.

The three row formats people already have (HF TRL's dataset formats):

    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}   chat, multi-turn;
                                                                                    loss on assistant turns
    {"prompt": "...", "response": "..."}                                           one exchange (also
                                                                                    "completion" for "response")
    {"text": "..."}                                                                 continual pretraining;
                                                                                    loss on every token

A row is checked as it is read; a malformed one is a ``DataError`` naming the file and the line
(JSONL) or row (Parquet), unless the caller asked to skip bad rows, in which case it is counted.
Files are read one row at a time (Parquet one record batch at a time), so a corpus larger than
memory streams through. ``content_hash`` fingerprints the files' bytes for the packed cache.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from thinpipe.config import ConfigError

SUFFIXES = (".jsonl", ".parquet")
ROLES = ("system", "user", "assistant", "tool")


class DataError(ConfigError):
    """A data file that cannot be read as training rows; the message names the file and the line."""


@dataclass(frozen=True)
class Row:
    """One training row: ``messages`` (chat, incl. a prompt/response pair) or ``text`` (plain)."""

    where: str                                  # "file:line", for messages
    messages: tuple[dict, ...] | None = None
    text: str | None = None


def data_files(path: str | Path) -> list[Path]:
    """The files a data path names: the file itself, or a folder's *.jsonl / *.parquet in name order."""
    p = Path(path)
    if p.is_file():
        if p.suffix not in SUFFIXES:
            raise DataError(f"{p}: not a .jsonl or .parquet file; give JSONL (one JSON object per line) or Parquet")
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))  # no .ipynb_checkpoints
        if not files:
            raise DataError(f"{p}: the folder holds no .jsonl or .parquet files")
        return files
    raise DataError(f"data {str(path)!r} is neither a built-in corpus (math, medical, synthetic) nor an existing file "
                    "or folder: give a corpus name or a .jsonl / .parquet path (file or folder); it does not exist")


def content_hash(files: list[Path]) -> str:
    """SHA-256 over the files' names (relative order) and bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def parse_row(obj, where: str) -> Row:
    """A checked ``Row`` from one decoded record; ``DataError`` naming ``where`` otherwise."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(obj).__name__}")
    obj = {k: v for k, v in obj.items() if v is not None}  # a Parquet column another row format fills
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: messages[{i}] must be an object with string \"role\" and \"content\"")
            if m["role"] not in ROLES:
                raise DataError(f"{where}: messages[{i}] has role {m['role']!r}; roles are {', '.join(ROLES)}")
            out.append({"role": m["role"], "content": m["content"]})
        if not any(m["role"] == "assistant" for m in out):
            raise DataError(f"{where}: the conversation has no assistant turn, so nothing to learn from: add one, or "
                            "use {\"text\": ...} rows for plain text")
        return Row(where, messages=tuple(out))
    if "prompt" in obj:
        response = obj.get("response", obj.get("completion"))
        if not isinstance(obj["prompt"], str) or not isinstance(response, str):
            raise DataError(f"{where}: a prompt row needs string \"prompt\" and \"response\" (or \"completion\")")
        return Row(where, messages=({"role": "user", "content": obj["prompt"]},
                                    {"role": "assistant", "content": response}))
    if "text" in obj:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise DataError(f"{where}: \"text\" must be a non-empty string")
        return Row(where, text=obj["text"])
    keys = ", ".join(sorted(map(str, obj))) or "none"
    raise DataError(f"{where}: a row needs \"messages\", \"prompt\" + \"response\", or \"text\" (it has: {keys})")


def _records(f: Path) -> Iterator[tuple[str, object]]:
    """(where, decoded record) of one file, streamed."""
    if f.suffix == ".jsonl":
        with open(f, "rb") as fh:  # bytes, so that a line that is not UTF-8 is named like any bad row
            for n, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    yield f"{f}:{n}", json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    yield f"{f}:{n}", DataError(f"{f}:{n}: not UTF-8 text (byte {e.start + 1} of the line): save the "
                                                "file as UTF-8")
                except json.JSONDecodeError as e:
                    yield f"{f}:{n}", DataError(f"{f}:{n}: not valid JSON ({e.msg} at column {e.colno})")
                except ValueError as e:  # an integer of more than 4300 digits (Python's int limit)
                    yield f"{f}:{n}", DataError(f"{f}:{n}: not a row of training data ({str(e).split(':')[0]})")
                except RecursionError:  # json's decoder recurses once per level
                    yield f"{f}:{n}", DataError(f"{f}:{n}: values nested thousands deep, which no row format has: "
                                                "fix the line, or set data.skip_bad_rows = true")
        return
    import pyarrow.parquet as pq

    n = 0
    try:  # pyarrow raises several kinds for a file that is not Parquet or is damaged
        for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
            for rec in batch.to_pylist():
                n += 1
                yield f"{f}:row {n}", rec
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"{f}: not a readable Parquet file after row {n} ({e})") from None


def read_rows(path: str | Path, skip_bad_rows: bool = False, skipped: list | None = None,
              exclude: list[Path] = ()) -> Iterator[Row]:
    """The checked rows of a data path, in file order. With ``skip_bad_rows`` a malformed row is left
    out and its error message appended to ``skipped``; without it, the first one raises. Files in
    ``exclude`` (the held-out files, when they sit inside a training folder) are not read; naming
    only held-out files is an error."""
    files = data_files(path)
    held = {Path(x).resolve() for x in exclude}
    files = [f for f in files if f.resolve() not in held]
    if not files:
        raise DataError(f"{path}: every file there is also the held-out data (data.val_name): give training files "
                        "that are not the held-out ones")
    for f in files:
        for where, rec in _records(f):
            try:
                if isinstance(rec, DataError):
                    raise rec
                yield parse_row(rec, where)
            except DataError as e:
                if not skip_bad_rows:
                    raise
                if skipped is not None:
                    skipped.append(str(e))
