"""How a joining replica receives a live peer's state: torchft's ``CheckpointTransport``, without pickles.

torchft's own transports deserialise what a peer sends with Python's object serialisation
(``HTTPTransport`` through a full ``torch.load``, ``PGTransport`` for its metadata), which can run
code and which this project never applies to anything read from a peer or a file. This one sends the state as the checkpoint files do
(``thinpipe/checkpoint.py``): the tree as JSON (tensors replaced by keys) and the tensors as
safetensors, over plain HTTP from the sender's rank:

  ``GET /checkpoint/{step}`` -> ``THINPIPE-STATE1`` | 8-byte big-endian JSON length | JSON | safetensors bytes

The receiver validates every part (magic, lengths, the step it asked for, a JSON tree of known
kinds, safetensors' own header checks) and refuses anything else with one line. The sender keeps
one serialised copy of its state from ``send_checkpoint`` until ``disallow_checkpoint`` (its next
commit: by then every joiner has fetched it, since the step's all-reduce needs them).
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torchft.checkpointing.transport import CheckpointTransport

from thinpipe.checkpoint import CheckpointError, decode_tree, encode_tree

MAGIC = b"THINPIPE-STATE1"
MAX_JSON_BYTES = 1 << 30


def encode_state(step: int, state) -> bytes:
    skeleton, tensors = encode_tree(state)
    head = json.dumps({"step": step, "tree": skeleton}).encode()
    return MAGIC + len(head).to_bytes(8, "big") + head + st_save(tensors)


def decode_state(blob: bytes, step: int, source: str):
    """The state ``encode_state`` wrote for ``step``; ``CheckpointError`` naming ``source`` otherwise."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"the state received from {source} is not valid ({why}); the replica cannot join")

    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 8:
        raise bad("it does not start with the thinpipe state header")
    n = int.from_bytes(blob[len(MAGIC):len(MAGIC) + 8], "big")
    start = len(MAGIC) + 8
    if n > MAX_JSON_BYTES or start + n > len(blob):
        raise bad(f"its JSON length {n} does not fit the {len(blob)} bytes received")
    try:
        head = json.loads(blob[start:start + n])
        tensors = st_load(bytes(blob[start + n:]))
    except (ValueError, SafetensorError) as e:
        raise bad(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if not isinstance(head, dict) or head.get("step") != step or "tree" not in head:
        raise bad(f"it is for step {head.get('step') if isinstance(head, dict) else '?'}, step {step} was asked for")
    return decode_tree(head["tree"], tensors)


class SafeTransport(CheckpointTransport):
    """A rank's state server (sender side) and client (receiver side) for torchft's recovery."""

    def __init__(self, timeout: timedelta, host: str | None = None):
        self.timeout = timeout
        self._ready = threading.Condition()
        self._staged: tuple[int, bytes] | None = None
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != "checkpoint" or not parts[1].isdigit():
                    self.send_error(404, "unknown path")
                    return
                # the joiner may ask before this rank's quorum thread has staged the state: wait for it
                with transport._ready:
                    transport._ready.wait_for(lambda: transport._staged is not None and
                                              str(transport._staged[0]) == parts[1], timeout.total_seconds())
                    staged = transport._staged
                if staged is None or str(staged[0]) != parts[1]:
                    self.send_error(404, "no state staged for that step")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(staged[1])))
                self.end_headers()
                self.wfile.write(staged[1])

            def log_message(self, *args):  # quiet: the engine reports joins itself
                pass

        self._server = ThreadingHTTPServer(("", 0), Handler)
        self._server.daemon_threads = True
        self._host = host or socket.gethostname()
        threading.Thread(target=self._server.serve_forever, name="thinpipe-state-server", daemon=True).start()

    def metadata(self) -> str:
        return f"http://{self._host}:{self._server.server_address[1]}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict, timeout: timedelta) -> None:
        blob = encode_state(step, state_dict)
        with self._ready:
            self._staged = (step, blob)
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._staged = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        url = f"{metadata}/checkpoint/{step}"
        with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as r:
            blob = r.read()
        return decode_state(blob, step, url)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
