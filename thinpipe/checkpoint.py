"""Checkpoints that load without running code: safetensors for tensors, JSON for the rest.

A checkpoint is a folder ``checkpoint/step{N:08d}/`` of *parts* (the simulation writes one part,
``mesh``; each rank of the real mesh writes its own, ``rank{r}``). A part is three files:

  ``{part}.safetensors``  every tensor of the state, keyed by its path in the tree
  ``{part}.json``         the tree, tensors replaced by ``{"__tensor__": key}``
  ``{part}.sha256``       the SHA-256 of the other two, written last: the part is complete once it exists

Each file is written to a temporary name, flushed to disk and renamed, so a crash (kill -9 mid-write)
leaves either a complete part or none; a set is complete when every part it needs is. Loading checks
the digests first and refuses a part whose files do not match, naming the file (a flipped byte, a
truncated write, an edited file); ``latest_complete`` then falls back to the newest older set that
verifies. Nothing here unpickles: safetensors holds raw tensors, JSON plain values, and the tree
decoder knows only dicts, lists, tuples, numbers, strings and tensors (anything else is refused when
saving, so no state can need a pickle).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import signal
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from thinpipe.config import ConfigError
from thinpipe.faults import kill_in_checkpoint_write

FORMAT = 1
STEP_DIR = re.compile(r"step(\d{8})$")
OS_ERROR = re.compile(r"\(os error (\d+)\)")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (corrupt, incomplete, foreign): one line naming the file."""


# ---------------------------------------------------------------------------------- the tree codec

def encode_tree(tree) -> tuple[object, dict[str, torch.Tensor]]:
    """(JSON-able skeleton, tensors by key) of nested dicts / lists / tuples of tensors and plain values."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}

    def enc(x, path: str):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu()
            # safetensors refuses tensors sharing memory: the second view of a storage is copied
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if t.numel() and ident in seen:
                return {"__tensor__": seen[ident]}
            if t.numel() and any(k[0] == ident[0] for k in seen):
                t = t.clone()
            key = path or "."
            tensors[key] = t.contiguous()
            if t.numel():
                seen[ident] = key
            if _permuted_dense(t) and not t.is_contiguous():
                # the layout too (a transposed Parameter's optimizer momentum): matmuls round by layout, so a
                # resumed run equals an uninterrupted one only if every tensor comes back with its strides
                return {"__tensor__": key, "stride": list(t.stride())}
            return {"__tensor__": key}
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"__float__": repr(x)}
        if isinstance(x, torch.dtype):
            return {"__dtype__": str(x).removeprefix("torch.")}
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: enc(v, f"{path}/{k}") for k, v in x.items()}
            return {"__items__": [[enc(k, f"{path}/#k{i}"), enc(v, f"{path}/{i}")]
                                  for i, (k, v) in enumerate(x.items())]}
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return {"__tuple__": [enc(v, f"{path}/{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(x)]
        raise TypeError(f"checkpoint state at {path or '/'} is a {type(x).__name__}: only tensors, numbers, strings, "
                        "lists, tuples and dicts are stored (no pickles)")

    return enc(tree, ""), tensors


def _permuted_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s strides are a permutation of a contiguous layout (no gaps, no overlap)."""
    dims = sorted(range(t.ndim), key=lambda d: (t.stride(d), -t.shape[d]))
    expected = 1
    for d in dims:
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def decode_tree(skeleton, tensors: dict[str, torch.Tensor]):
    """The inverse of ``encode_tree``; refuses anything it does not know."""
    def dec(x):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            if "__tensor__" in x:
                if x["__tensor__"] not in tensors:
                    raise CheckpointError(f"checkpoint names a tensor {x['__tensor__']!r} its tensor file lacks")
                t = tensors[x["__tensor__"]]
                if "stride" in x:
                    stride = tuple(int(s) for s in x["stride"])
                    probe = torch.empty_strided(t.shape, stride, dtype=t.dtype, device="meta")
                    if len(stride) != t.ndim or not _permuted_dense(probe):
                        raise CheckpointError(f"checkpoint gives tensor {x['__tensor__']!r} an invalid layout {stride}")
                    t = torch.empty_strided(t.shape, stride, dtype=t.dtype).copy_(t)
                return t
            if "__float__" in x:
                return float(x["__float__"])
            if "__dtype__" in x:
                dtype = getattr(torch, str(x["__dtype__"]), None)
                if not isinstance(dtype, torch.dtype):
                    raise CheckpointError(f"checkpoint names an unknown dtype {x['__dtype__']!r}")
                return dtype
            if "__tuple__" in x:
                return tuple(dec(v) for v in x["__tuple__"])
            if "__items__" in x:
                return {dec(k): dec(v) for k, v in x["__items__"]}
            return {k: dec(v) for k, v in x.items()}
        raise CheckpointError(f"checkpoint holds a value of JSON type {type(x).__name__} it cannot decode")

    return dec(skeleton)


# ---------------------------------------------------------------------------------- files

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, write) -> None:
    """``write(tmp_path)`` then fsync and rename onto ``path``: all or nothing."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _killed_here_in_tests(folder: Path) -> None:
    """THINPIPE_TEST_KILL_IN_CHECKPOINT_WRITE=N: SIGKILL this process half-way through writing the set
    of step N (the tensors written, the tree and digests not): what a crash leaves (tests only)."""
    at = kill_in_checkpoint_write()
    if at >= 0 and folder.name == f"step{at:08d}":
        os.kill(os.getpid(), signal.SIGKILL)


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step{step:08d}"


def save_part(folder: Path, part: str, state) -> None:
    """Write ``state`` as part ``part`` of the set in ``folder`` (tensors, tree, then the digests)."""
    skeleton, tensors = encode_tree(state)
    st, js = folder / f"{part}.safetensors", folder / f"{part}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(st, lambda tmp: save_file(tensors, tmp, metadata={"format": str(FORMAT)}))
        _killed_here_in_tests(folder)
        _write_atomic(js, lambda tmp: Path(tmp).write_text(json.dumps({"format": FORMAT, "state": skeleton})))
        digests = {st.name: _sha256(st), js.name: _sha256(js)}
        _write_atomic(folder / f"{part}.sha256", lambda tmp: Path(tmp).write_text(json.dumps(digests)))
    except (OSError, SafetensorError) as e:
        # nothing is lost: the part has no digests, so it is incomplete and --resume takes the set before it.
        # safetensors reports the OS's error in its message: "I/O error: No space left on device (os error 28)"
        code = e.errno if isinstance(e, OSError) else int(m.group(1)) if (m := OS_ERROR.search(str(e))) else None
        if code is None:
            raise
        if code in (errno.ENOSPC, errno.EDQUOT):
            raise CheckpointError(f"no space left on device while writing the checkpoint in {folder}: free space "
                                  "and run again with --resume") from None
        raise CheckpointError(f"cannot write the checkpoint in {folder} ({os.strerror(code)}): fix that and run "
                              "again with --resume") from None


def part_complete(folder: Path, part: str) -> bool:
    return (folder / f"{part}.sha256").is_file()


def verify_part(folder: Path, part: str) -> None:
    """Raise ``CheckpointError`` (one line naming the file) unless every file of the part matches its digest."""
    sums = folder / f"{part}.sha256"
    if not sums.is_file():
        raise CheckpointError(f"{folder}: part {part} is incomplete (no {sums.name}): the write was interrupted")
    try:
        digests = json.loads(sums.read_text())
        assert isinstance(digests, dict) and set(digests) == {f"{part}.safetensors", f"{part}.json"}
    except (ValueError, AssertionError, UnicodeDecodeError):
        raise CheckpointError(f"{sums}: damaged digest file; the checkpoint cannot be verified") from None
    for name, digest in digests.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        if _sha256(path) != digest:
            raise CheckpointError(f"{path} does not match its SHA-256 in {sums.name}: "
                                  "the file is corrupt or was edited")


def verifies(folder: Path, parts: list[str]) -> bool:
    try:
        for p in parts:
            verify_part(folder, p)
    except CheckpointError:
        return False
    return True


def load_part(folder: Path, part: str):
    """The state of part ``part``, after checking every file against its digest."""
    verify_part(folder, part)
    try:
        tensors = load_file(folder / f"{part}.safetensors")
        doc = json.loads((folder / f"{part}.json").read_text())
    except (SafetensorError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{folder / part}: unreadable checkpoint part ({_line(e)})") from None
    except RecursionError:
        raise CheckpointError(f"{folder / f'{part}.json'} nests values thousands deep, which thinpipe never "
                              "writes: the file was edited") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "state" not in doc:
        raise CheckpointError(f"{folder / f'{part}.json'}: checkpoint format "
                              f"{doc.get('format') if isinstance(doc, dict) else '?'}"
                              f" is not {FORMAT}")
    try:
        return decode_tree(doc["state"], tensors)
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as e:  # a marker of a foreign shape
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{folder / f'{part}.json'} holds a value thinpipe did not write ({type(e).__name__}: "
                              f"{_line(e)}): the file was edited") from None


def _line(e: Exception) -> str:
    """An exception's message on one line (torch's and safetensors' span several)."""
    return " ".join(str(e).split())[:200]


@contextlib.contextmanager
def restoring(root: Path):
    """Around restoring a loaded state into a run: a state whose digests verify but which is not what this
    thinpipe saves (a hand-edited part with recomputed digests, keys or types changed) fails in one line
    instead of a ``KeyError`` deep in the engine."""
    try:
        yield
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        # torch's load_state_dict raises RuntimeError for missing keys and shapes; any other
        # RuntimeError (a peer that died during a dist resume) is not the checkpoint's fault
        if isinstance(e, RuntimeError) and "state_dict" not in str(e):
            raise
        why = f"no key {e}" if isinstance(e, KeyError) else _line(e)
        raise CheckpointError(f"the checkpoint in {root} does not hold the state thinpipe saves ({why}): it was edited "
                              "or written by another version; restore its files, or train again") from None


def sets(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every set under ``root``, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(out, reverse=True)


def latest_complete(root: Path, part: str, warn=None) -> tuple[int, dict] | None:
    """(step, state: the dict the part was saved from) of the newest set whose part ``part`` verifies; an
    older set is used when a newer one does not (``warn`` gets one line saying why). None: no set at all."""
    errors = []
    for step, folder in sets(root):
        try:
            state = load_part(folder, part)
        except CheckpointError as e:
            errors.append((step, str(e)))
            continue
        if warn is not None:  # only when an older set is used: with none usable, the error alone says it
            for skipped, why in errors:
                warn(f"[thinpipe] skipping checkpoint step {skipped}: {why}")
        return step, state
    if errors:
        raise CheckpointError(f"no usable checkpoint in {root}: {errors[0][1]}")
    return None


def remove_parts(folder: Path, parts: list[str]) -> None:
    """Delete ``parts`` of a set (each rank deletes only its own), and the folder once it is empty."""
    for p in parts:
        for suffix in (".sha256", ".json", ".safetensors"):   # the digest first: the part is incomplete at once
            (folder / f"{p}{suffix}").unlink(missing_ok=True)
    try:
        leftovers = [t for t in folder.iterdir() if any(t.name.startswith(f".{p}.") for p in parts)]
    except FileNotFoundError:
        return  # another rank removed its last part and the emptied folder meanwhile
    for tmp in leftovers:                                       # a write interrupted by a crash
        tmp.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # other ranks' parts are still there (or the folder is gone already)


def prune(root: Path, keep: int, parts: list[str], upto: int | None = None) -> None:
    """Keep the newest ``keep`` sets whose ``parts`` verify, and any set newer than the newest of them
    (another rank may still be writing it); remove ``parts`` of the rest (older, damaged or incomplete).
    ``upto``: only sets of that step or older are considered (newer ones are kept), for a rank that
    learns late which set all ranks completed (the anchor's, ``anchor/dist_rank.py``)."""
    kept = 0
    for step, folder in sets(root):
        if upto is not None and step > upto:
            continue
        if kept >= keep:
            remove_parts(folder, parts)
        elif verifies(folder, parts):
            kept += 1
        elif kept:
            remove_parts(folder, parts)


def legacy_pickle(root: Path) -> Path | None:
    """A checkpoint written by thinpipe before this format (pickles), if ``root`` holds one."""
    root = Path(root)
    old = [root / "state.pt", root / "latest.json"]
    return next((p for p in old if p.is_file()), None)


def refuse_legacy(root: Path) -> None:
    old = legacy_pickle(root)
    if old is not None:
        raise CheckpointError(f"{old} is a checkpoint of an older thinpipe, stored as Python pickles, which can run "
                              "code when loaded and are not read: resume it with the thinpipe version that wrote it, "
                              "or start the run again")


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` (a run folder) holds at least one checkpoint set (verified when loaded)."""
    return bool(sets(Path(run_dir) / "checkpoint"))
