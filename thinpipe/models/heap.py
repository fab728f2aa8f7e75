"""Giving a CPU process's freed activation memory back to the system as a stage computes (``train.cpu_heap_trim``).

glibc's malloc serves blocks under its mmap threshold (up to 32 MiB) from the heap and keeps them when they are
freed; later blocks reuse them only in part. A decoder layer's forward frees many such blocks (its temporaries), so
a CPU rank's resident set grew by about twice what the layers keep for the backward (measured: llama-150m, LoRA,
2 x 2,048 tokens, one stage: 5.56 GiB peak RSS; with a trim after each layer 3.47 GiB, what the saved tensors
predict; docs/memory.md). ``malloc_trim(0)`` returns every whole free page of every arena (since glibc 2.8). Other C
libraries (musl, macOS): nothing to call, nothing done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def release_freed_heap() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``); a no-op elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
