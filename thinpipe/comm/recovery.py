"""How a joining replica receives a live peer's state: torchft's ``CheckpointTransport``, without pickles,
only between ranks that hold the job key (docs/security.md, "Elastic replicas: torchft and recovery").

torchft's own transports deserialise what a peer sends with Python's object serialisation
(``HTTPTransport`` through a full ``torch.load``, ``PGTransport`` for its metadata), which can run
code and which this project never applies to anything read from a peer or a file. This one sends the
state as the checkpoint files do (``comm/state_blob.py``: the tree as JSON, tensors replaced by keys,
and the tensors as safetensors), over plain HTTP from the sender's rank, listening on the job's
address only (``comm/bind.py``):

  ``GET /checkpoint/{step}``, ``Authorization: thinpipe-mac ts=T, nonce=N, mac=M``
  -> ``THINPIPE-STATE1`` | 8-byte big-endian JSON length | JSON | safetensors bytes,
     ``X-Thinpipe-State-MAC: R``

Both directions prove the job key (``comm/jobkey.py``). The request: ``M`` = MAC (sub-key
"recovery-request") over the path, a wall-clock time ``T`` and a random ``N``; the server refuses
with 403, before it looks at any state, a request whose MAC is wrong, whose ``T`` is more than
``FRESH_S`` away from its own clock, or whose ``N`` it has already served (a replay). The answer:
``R`` = MAC (sub-key "recovery-state") over the request's ``N`` and the state's tag, the MAC over
the step and the whole blob (computed once when the state is staged): the joiner checks ``R``
before it decodes a byte, so a state from a stranger (or a recording of an earlier answer) is
refused in one line naming its URL.

The receiver decides what it reads: a size cap (``max_bytes``: the announced Content-Length is
checked before reading and reading stops there), one deadline for the whole transfer (a peer that
drip-feeds bytes fails at it), a JSON tree at most ``MAX_DEPTH`` deep, and it validates every part
(``state_blob.py``: magic, lengths, the step it asked for, a JSON tree of known kinds, safetensors'
own header checks); every refusal is one line (``CheckpointError``). The server gives a connection
``HEADER_DEADLINE_S`` to send its request and handles at most ``slots`` at once: when they are full,
a new connection displaces the oldest one that is still sending its request, so half-open
connections cannot lock a joiner out. The sender keeps one serialised copy of its state from ``send_checkpoint`` until
``disallow_checkpoint`` (its next commit: by then every joiner has fetched it, since the step's
all-reduce needs them).
"""

from __future__ import annotations

import io
import secrets
import socket
import threading
import time
import urllib.parse
from collections import OrderedDict
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Callable

from torchft.checkpointing.transport import CheckpointTransport

from thinpipe.checkpoint import CheckpointError
from thinpipe.comm.bind import ANY, bind_address
from thinpipe.comm.jobkey import derive, mac, same
from thinpipe.comm.state_blob import decode_state, encode_state

DEFAULT_MAX_BYTES = 1 << 34    # what a joiner accepts when nothing tells it what to expect (16 GiB)
OWN_STATE_FACTOR = 4           # ... or this many times the state it last sent itself
FRESH_S = 300.0                # a request's time may differ this much from the server's clock (and nonces are kept 2x)
HEADER_DEADLINE_S = 3.0        # a connection's whole request (a few hundred bytes, one packet) within this
HEADER_LIMIT = 16 << 10
SLOTS = 8                      # requests served at once
BUSY_RETRY_S = 0.2
AUTH_SCHEME = "thinpipe-mac"
STATE_MAC_HEADER = "X-Thinpipe-State-MAC"


def state_tag(key: bytes, step: int, blob) -> bytes:
    """The MAC of one staged state: its step and every byte of it (sub-key "recovery-state")."""
    return mac(key, str(step).encode(), blob)


def answer_mac(key: bytes, nonce: bytes, tag: bytes) -> bytes:
    """What an answer to the request carrying ``nonce`` is signed with (a recording cannot answer another request)."""
    return mac(key, b"answer", nonce, tag)


def request_mac(key: bytes, path: str, ts: str, nonce: bytes) -> bytes:
    return mac(key, path.encode(), ts.encode(), nonce)


def authorization(key: bytes, path: str, now: float | None = None, nonce: bytes | None = None) -> tuple[str, bytes]:
    """(the ``Authorization`` header value for GET ``path``, its nonce); ``key`` is the "recovery-request" sub-key."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_bytes(16) if nonce is None else nonce
    return f"{AUTH_SCHEME} ts={ts}, nonce={nonce.hex()}, mac={request_mac(key, path, ts, nonce).hex()}", nonce


def _parse_authorization(value: str) -> tuple[str, bytes, bytes] | None:
    scheme, _, rest = value.partition(" ")
    if scheme != AUTH_SCHEME:
        return None
    fields = dict(part.strip().partition("=")[::2] for part in rest.split(","))
    try:
        ts, nonce, got = fields["ts"], bytes.fromhex(fields["nonce"]), bytes.fromhex(fields["mac"])
        float(ts)
    except (KeyError, ValueError):
        return None
    return ts, nonce, got


class _Busy(Exception):
    """The peer closed a connection without answering (all its slots were taken): try again."""


class _StateServer(HTTPServer):
    """An HTTP server with at most ``slots`` handler threads; when they are full a new connection
    displaces the oldest one still sending its request (only a complete request holds a slot for long)."""

    request_queue_size = 128

    def __init__(self, address, handler, slots: int):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(slots)
        self._reading: OrderedDict[socket.socket, None] = OrderedDict()
        self._lock = threading.Lock()

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            with self._lock:
                oldest = next(iter(self._reading), None)
                self._reading.pop(oldest, None)
            if oldest is not None:
                try:
                    oldest.shutdown(socket.SHUT_RDWR)  # its handler's recv returns: the slot frees in a moment
                except OSError:
                    pass
            if not self._slots.acquire(timeout=1.0):
                self.shutdown_request(request)  # every slot serves a real request: the client retries
                return
        with self._lock:
            self._reading[request] = None
        threading.Thread(target=self._serve, args=(request, client_address), daemon=True,
                         name="thinpipe-state-handler").start()

    def _serve(self, request, client_address):
        try:
            self.finish_request(request, client_address)
        except OSError:
            pass  # a peer that went away, or one displaced while sending its request
        finally:
            self.read_done(request)
            self.shutdown_request(request)
            self._slots.release()

    def read_done(self, request) -> None:
        with self._lock:
            self._reading.pop(request, None)


class SafeTransport(CheckpointTransport):
    """A rank's state server (sender side) and client (receiver side) for torchft's recovery.

    ``key``: the job key (``comm/jobkey.py``). ``max_bytes``: the most a received state may be (an
    int, or a function giving it when a state is received); by default ``OWN_STATE_FACTOR`` times the
    state this rank last sent, else ``DEFAULT_MAX_BYTES``. ``deadline``: how long a whole transfer
    may take (default: the ``timeout`` torchft gives each call). ``host``: the address advertised to
    joiners (default: the one the server binds, ``bind_address()``).
    """

    def __init__(self, timeout: timedelta, key: bytes, host: str | None = None,
                 max_bytes: int | Callable[[], int] | None = None, deadline: timedelta | None = None,
                 slots: int = SLOTS):
        self.timeout, self.deadline, self.max_bytes = timeout, deadline, max_bytes
        self._request_key, self._state_key = derive(key, "recovery-request"), derive(key, "recovery-state")
        self._ready = threading.Condition()
        self._staged: tuple[int, bytes, bytes] | None = None  # (step, blob, tag)
        self._own_size = 0
        self._seen: dict[bytes, float] = {}  # nonces served, with when (replays are refused)
        self._seen_lock = threading.Lock()
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def handle(self):
                # the whole request within HEADER_DEADLINE_S (a per-read timeout would let a drip-feed hold the slot)
                end, buf = time.monotonic() + HEADER_DEADLINE_S, b""
                while b"\r\n\r\n" not in buf:
                    left = end - time.monotonic()
                    if left <= 0 or len(buf) > HEADER_LIMIT:
                        return
                    self.connection.settimeout(left)
                    try:
                        chunk = self.connection.recv(4096)
                    except OSError:
                        return
                    if not chunk:
                        return
                    buf += chunk
                self.server.read_done(self.connection)
                self.connection.settimeout(transport._transfer_s(transport.timeout))  # bounds the whole answer
                self.rfile.close()
                self.rfile = io.BytesIO(buf)
                self.close_connection = True
                self.handle_one_request()

            def do_GET(self):  # noqa: N802 - http.server's name
                nonce = transport._authorized(self.path, self.headers.get("Authorization", ""))
                if nonce is None:
                    self.send_error(403, "this server serves only ranks of its job (a request MACed with the job key)")
                    return
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
                self.send_header(STATE_MAC_HEADER, answer_mac(transport._state_key, nonce, staged[2]).hex())
                self.end_headers()
                self.wfile.write(staged[1])

            def log_message(self, *args):  # quiet: the engine reports joins itself
                pass

        addr = bind_address()
        self._server = _StateServer((addr, 0), Handler, slots)
        self._host = host or (socket.gethostname() if addr == ANY else addr)
        threading.Thread(target=self._server.serve_forever, name="thinpipe-state-server", daemon=True).start()

    # the server's side ----------------------------------------------------------------------------
    def _authorized(self, path: str, header: str) -> bytes | None:
        """The request's nonce if it proves the key, is fresh and is not a replay; else None."""
        parsed = _parse_authorization(header)
        if parsed is None:
            return None
        ts, nonce, got = parsed
        now = time.time()
        if abs(now - float(ts)) > FRESH_S or not same(got, request_mac(self._request_key, path, ts, nonce)):
            return None
        with self._seen_lock:
            if nonce in self._seen:
                return None
            self._seen = {n: t for n, t in self._seen.items() if now - t < 2 * FRESH_S}
            self._seen[nonce] = now
        return nonce

    def metadata(self) -> str:
        return f"http://{self._host}:{self._server.server_address[1]}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict, timeout: timedelta) -> None:
        blob = encode_state(step, state_dict)
        tag = state_tag(self._state_key, step, blob)
        with self._ready:
            self._staged = (step, blob, tag)
            self._own_size = len(blob)
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._staged = None

    # the joiner's side ----------------------------------------------------------------------------
    def _transfer_s(self, timeout: timedelta) -> float:
        return (self.deadline or timeout).total_seconds()

    def _cap(self) -> int:
        if self.max_bytes is not None:
            return int(self.max_bytes() if callable(self.max_bytes) else self.max_bytes)
        return OWN_STATE_FACTOR * self._own_size if self._own_size else DEFAULT_MAX_BYTES

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        url = f"{metadata}/checkpoint/{step}"
        seconds = self._transfer_s(timeout)
        deadline = time.monotonic() + seconds
        peer = urllib.parse.urlparse(metadata)
        if peer.scheme != "http" or not peer.hostname or peer.port is None:
            raise CheckpointError(f"the peer's recovery address {metadata!r} is not http://HOST:PORT; the replica "
                                  "cannot join")
        path = f"/checkpoint/{step}"
        cap = self._cap()
        while True:
            header, nonce = authorization(self._request_key, path)
            try:
                status, headers, body = _fetch(peer.hostname, peer.port, path, header, deadline, cap, url, seconds)
                break
            except _Busy:
                if time.monotonic() + BUSY_RETRY_S >= deadline:
                    raise CheckpointError(f"{url} kept closing the connection without an answer for {seconds:g} s "
                                          "(its slots are taken); the replica cannot join") from None
                time.sleep(BUSY_RETRY_S)
        if status == 403:
            raise CheckpointError(f"{url} refused this replica's request (403): it holds another job key "
                                  "($THINPIPE_JOB_KEY_FILE must name the same key on every machine)")
        if status != 200:
            raise CheckpointError(f"{url} answered HTTP {status} (no state for step {step}); the replica cannot join")
        signed = headers.get(STATE_MAC_HEADER.lower(), "")
        try:
            got = bytes.fromhex(signed)
        except ValueError:
            got = b""
        if not same(got, answer_mac(self._state_key, nonce, state_tag(self._state_key, step, body))):
            raise CheckpointError(f"the state received from {url} is not signed with this job's key (another job's "
                                  "replica, or not a replica of this job): refused")
        return decode_state(body, step, url)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()


def _fetch(host: str, port: int, path: str, authorization_value: str, deadline: float, cap: int, url: str,
           seconds: float) -> tuple[int, dict[str, str], bytearray]:
    """(status, lower-cased headers, body) of one GET; the body only for a 200, at most ``cap`` bytes, all of it
    before ``deadline`` (``time.monotonic()``)."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"the state received from {url} is not valid ({why}); the replica cannot join")

    def left() -> float:
        rest = deadline - time.monotonic()
        if rest <= 0:
            raise socket.timeout
        return rest

    try:
        with socket.create_connection((host, port), timeout=left()) as sock:
            sock.settimeout(left())
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\nAuthorization: {authorization_value}\r\n"
                         "Connection: close\r\n\r\n".encode())
            buf = bytearray()
            while (end := buf.find(b"\r\n\r\n")) < 0:
                if len(buf) > HEADER_LIMIT:
                    raise bad(f"its answer's headers exceed {HEADER_LIMIT} bytes")
                sock.settimeout(left())
                chunk = sock.recv(4096)
                if not chunk:
                    if not buf:
                        raise _Busy
                    raise bad("the connection closed inside the answer's headers")
                buf += chunk
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            status_line = lines[0].split(" ", 2)
            if len(status_line) < 2 or not status_line[0].startswith("HTTP/") or not status_line[1].isdigit():
                raise bad("its answer is not HTTP")
            status = int(status_line[1])
            headers = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            if status == 503:
                raise _Busy
            if status != 200:
                return status, headers, bytearray()
            length = headers.get("content-length", "")
            if not length.isdigit() or "transfer-encoding" in headers:
                raise bad("its answer gives no Content-Length")
            n = int(length)
            if n > cap:
                raise bad(f"it announces {n} bytes, more than the {cap} this replica accepts")
            body = bytearray(n)
            view = memoryview(body)
            got = min(n, len(buf) - end - 4)
            view[:got] = buf[end + 4:end + 4 + got]
            while got < n:
                sock.settimeout(left())
                k = sock.recv_into(view[got:], min(n - got, 1 << 20))
                if k == 0:
                    raise bad(f"the connection closed after {got} of its {n} bytes")
                got += k
            return status, headers, body
    except (socket.timeout, TimeoutError):
        raise CheckpointError(f"the state from {url} did not arrive within {seconds:g} s (one deadline for the "
                              "whole transfer); the replica cannot join") from None
    except ConnectionResetError:
        raise _Busy from None
    except OSError as e:
        raise CheckpointError(f"cannot fetch the state from {url}: {e.strerror or e}; the replica cannot "
                              "join") from None
