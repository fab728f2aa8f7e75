"""A replica's live state as one blob, the way the checkpoint files store it: no pickle on the way in.

``THINPIPE-STATE1`` | 8-byte big-endian JSON length | JSON ``{"step", "tree"}`` | safetensors bytes

The tree is ``thinpipe/checkpoint.py``'s (tensors replaced by keys), the tensors safetensors, so
decoding runs no code from the peer (docs/security.md, "Elastic replicas: torchft and recovery").
The decoder trusts nothing: it checks the magic and the lengths, refuses a JSON tree deeper than
``MAX_DEPTH`` before parsing it (a hostile one would hit json's recursion limit), checks that the
state is for the step asked for and leaves the tensors to safetensors' own header checks; every
refusal is one ``CheckpointError`` line naming where the blob came from. ``recovery.py`` carries
it between replicas.
"""

from __future__ import annotations

import json
import re

from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from thinpipe.checkpoint import CheckpointError, decode_tree, encode_tree

MAGIC = b"THINPIPE-STATE1"
MAX_JSON_BYTES = 1 << 30
MAX_DEPTH = 64                 # a state's tree is ~15 deep; a hostile one can be 200k (json's RecursionError)
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(rb"[\[\]{}]")


def encode_state(step: int, state) -> bytes:
    skeleton, tensors = encode_tree(state)
    head = json.dumps({"step": step, "tree": skeleton}).encode()
    return MAGIC + len(head).to_bytes(8, "big") + head + st_save(tensors)


def _too_deep(text: bytes) -> bool:
    """Whether the JSON ``text`` nests deeper than ``MAX_DEPTH`` (strings skipped; stops at the first excess)."""
    depth = 0
    for m in _BRACKETS.finditer(_STRINGS.sub(b'""', text)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        if depth > MAX_DEPTH:
            return True
    return False


def decode_state(blob: bytes | bytearray, step: int, source: str):
    """The state ``encode_state`` wrote for ``step``; ``CheckpointError`` naming ``source`` otherwise."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"the state received from {source} is not valid ({why}); the replica cannot join")

    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 8:
        raise bad("it does not start with the thinpipe state header")
    n = int.from_bytes(blob[len(MAGIC):len(MAGIC) + 8], "big")
    start = len(MAGIC) + 8
    if n > MAX_JSON_BYTES or start + n > len(blob):
        raise bad(f"its JSON length {n} does not fit the {len(blob)} bytes received")
    text = bytes(blob[start:start + n])
    if _too_deep(text):
        raise bad(f"its JSON nests deeper than {MAX_DEPTH} levels")
    try:
        head = json.loads(text)
        tensors = st_load(bytes(blob[start + n:]))
    except (ValueError, SafetensorError, RecursionError) as e:
        raise bad(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if not isinstance(head, dict) or head.get("step") != step or "tree" not in head:
        raise bad(f"it is for step {head.get('step') if isinstance(head, dict) else '?'}, step {step} was asked for")
    try:
        return decode_tree(head["tree"], tensors)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise bad(f"its tree is not a thinpipe state ({type(e).__name__})") from None
