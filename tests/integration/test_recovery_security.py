"""Hostile peers against the elastic engine's recovery and torchft's listeners (comm/recovery.py,
engine/elastic_rank.py, launch_elastic.py; docs/security.md, "Elastic replicas: torchft and recovery").

Fast tests run a real state server (``SafeTransport``) or a fake hostile one on 127.0.0.1 in this
process; the slow one lists the listening sockets of a real ``thinpipe launch --elastic`` job.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch

from tests.listeners import descendants, listening
from thinpipe.checkpoint import CheckpointError
from thinpipe.comm import recovery
from thinpipe.comm.jobkey import derive
from thinpipe.comm.recovery import SafeTransport, answer_mac, authorization, state_tag
from thinpipe.comm.state_blob import MAGIC, MAX_DEPTH, decode_state, encode_state

KEY, OTHER = secrets.token_bytes(32), secrets.token_bytes(32)
STATE = {"user": {"thinpipe": {"rank": {"stage": {"w": torch.randn(64, 64)}}, "members": [0, 1]}},
         "torchft": {"step": 5, "batches_committed": 10}}


@pytest.fixture
def sender():
    tr = SafeTransport(timedelta(seconds=2), KEY)
    yield tr
    tr.shutdown()


def joiner(key=KEY, seconds: float = 10.0, **kw) -> SafeTransport:
    return SafeTransport(timedelta(seconds=seconds), key, **kw)


def fetch(tr: SafeTransport, metadata: str, step: int = 5, seconds: float = 10.0):
    try:
        return tr.recv_checkpoint(0, metadata, step, timedelta(seconds=seconds))
    finally:
        tr.shutdown()


class Fake:
    """A hostile recovery server: reads one request per connection, then ``respond(conn, request)``."""

    def __init__(self, respond):
        self.respond, self.requests = respond, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._loop, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _loop(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        req = b""
        try:
            while b"\r\n\r\n" not in req:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                req += chunk
            self.requests.append(req)
            self.respond(conn, req)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.sock.close()


def answer(body: bytes, key: bytes | None, req: bytes, step: int = 5, length: int | None = None) -> bytes:
    """An HTTP answer carrying ``body``, signed with ``key`` for the request (unsigned when None)."""
    head = f"HTTP/1.0 200 OK\r\nContent-Length: {len(body) if length is None else length}\r\n"
    if key is not None:
        nonce = bytes.fromhex(re.search(rb"nonce=([0-9a-f]+)", req).group(1).decode())
        k = derive(key, "recovery-state")
        head += f"X-Thinpipe-State-MAC: {answer_mac(k, nonce, state_tag(k, step, body)).hex()}\r\n"
    return (head + "\r\n").encode() + body


@pytest.fixture
def fake():
    made = []

    def make(respond):
        made.append(Fake(respond))
        return made[-1]
    yield make
    for f in made:
        f.close()


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


# ------------------------------------------------------------------------- the key, both ways

def test_a_joiner_with_the_key_gets_the_state_and_the_server_listens_on_loopback_only(sender):
    assert sender.metadata().startswith("http://127.0.0.1:")
    assert [a for _, a, port in listening([os.getpid()]) if port == sender._server.server_address[1]] == ["127.0.0.1"]
    sender.send_checkpoint([1], 5, STATE, timedelta(seconds=1))
    got = fetch(joiner(), sender.metadata())
    assert torch.equal(got["user"]["thinpipe"]["rank"]["stage"]["w"], STATE["user"]["thinpipe"]["rank"]["stage"]["w"])
    assert got["torchft"] == STATE["torchft"]


def test_a_stranger_is_refused_with_403_before_the_server_looks_at_any_state(sender):
    # nothing staged: a request that proved the key would wait for a state (up to 2 s); these are refused at once
    url = sender.metadata() + "/checkpoint/5"
    t0 = time.perf_counter()
    for headers in ({}, {"Authorization": "thinpipe-mac ts=1, nonce=00, mac=00"},
                    {"Authorization": authorization(derive(OTHER, "recovery-request"), "/checkpoint/5")[0]}):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5)
        assert e.value.code == 403
    assert time.perf_counter() - t0 < 1.5
    with pytest.raises(CheckpointError, match=r"refused this replica's request \(403\): it holds another job key") as e:
        fetch(joiner(OTHER), sender.metadata())
    one_line(e)
    # staged now: still nothing for a stranger (a GET without the key's MAC)
    sender.send_checkpoint([1], 5, STATE, timedelta(seconds=1))
    with pytest.raises(urllib.error.HTTPError, match="403"):
        urllib.request.urlopen(url, timeout=5)


def test_a_replayed_or_stale_request_is_refused(sender):
    sender.send_checkpoint([1], 5, STATE, timedelta(seconds=1))
    path = "/checkpoint/5"
    url = sender.metadata() + path
    header, _ = authorization(derive(KEY, "recovery-request"), path)
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": header}), timeout=5) as r:
        assert r.status == 200 and r.read().startswith(MAGIC)
    with pytest.raises(urllib.error.HTTPError, match="403"):  # the same request again: a replay
        urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": header}), timeout=5)
    stale, _ = authorization(derive(KEY, "recovery-request"), path, now=time.time() - 2 * recovery.FRESH_S)
    with pytest.raises(urllib.error.HTTPError, match="403"):
        urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": stale}), timeout=5)
    other_step, _ = authorization(derive(KEY, "recovery-request"), "/checkpoint/6")  # MACed for another path
    with pytest.raises(urllib.error.HTTPError, match="403"):
        urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": other_step}), timeout=5)


@pytest.mark.parametrize("signer", [None, OTHER], ids=["unsigned", "another key"])
def test_a_replica_told_to_heal_from_an_outsider_refuses_its_well_formed_state(fake, signer):
    f = fake(lambda conn, req: conn.sendall(answer(encode_state(5, STATE), signer, req)))
    with pytest.raises(CheckpointError) as e:
        fetch(joiner(), f.url)
    assert one_line(e) == (f"the state received from {f.url}/checkpoint/5 is not signed with this job's key (another "
                           "job's replica, or not a replica of this job): refused")
    assert b"Authorization: thinpipe-mac" in f.requests[0]


def test_a_recorded_answer_does_not_answer_another_request(fake, sender):
    """A man in the middle who recorded a real answer (a signed state) cannot replay it to a joiner."""
    sender.send_checkpoint([1], 5, STATE, timedelta(seconds=1))
    path = "/checkpoint/5"
    header, _ = authorization(derive(KEY, "recovery-request"), path)
    with socket.create_connection(("127.0.0.1", sender._server.server_address[1]), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nAuthorization: {header}\r\n\r\n".encode())
        recorded = b""
        while chunk := s.recv(1 << 16):
            recorded += chunk
    assert recorded.startswith(b"HTTP/1.0 200") and recovery.STATE_MAC_HEADER.encode() in recorded
    f = fake(lambda conn, req: conn.sendall(recorded))
    with pytest.raises(CheckpointError, match="is not signed with this job's key"):
        fetch(joiner(), f.url)


# ----------------------------------------------------------------------- what a joiner reads

def test_an_oversized_content_length_is_refused_before_reading(fake):
    held = threading.Event()

    def huge(conn, req):
        conn.sendall(answer(b"", KEY, req, length=10**12))
        held.wait(20)  # and never sends a byte of it
    f = fake(huge)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError) as e:
        fetch(joiner(max_bytes=1 << 20), f.url, seconds=30)
    held.set()
    assert f"it announces {10**12} bytes, more than the {1 << 20} this replica accepts" in one_line(e)
    assert time.perf_counter() - t0 < 5


def test_the_default_cap_is_a_multiple_of_the_state_this_rank_sent(fake):
    tr = joiner()
    assert tr._cap() == recovery.DEFAULT_MAX_BYTES
    tr.send_checkpoint([1], 5, STATE, timedelta(seconds=1))
    assert tr._cap() == recovery.OWN_STATE_FACTOR * len(encode_state(5, STATE))
    assert joiner(max_bytes=lambda: 123)._cap() == 123
    f = fake(lambda conn, req: conn.sendall(answer(secrets.token_bytes(tr._cap() + 1), KEY, req)))
    with pytest.raises(CheckpointError, match="more than the"):
        fetch(tr, f.url)


def test_junk_is_refused_in_one_line_and_reading_stops_at_the_announced_length(fake):
    junk = secrets.token_bytes(1 << 20)
    sent = []

    def flood(conn, req):  # announces 1 KiB, then sends 64 MiB more
        conn.sendall(answer(junk[:1024], None, req))
        for _ in range(64):
            conn.sendall(junk)
            sent.append(len(junk))
    f = fake(flood)
    with pytest.raises(CheckpointError, match="not signed with this job's key") as e:
        fetch(joiner(), f.url)
    one_line(e)
    # signed junk (a replica of this job gone wrong): the MAC holds, the decoder still refuses it
    f2 = fake(lambda conn, req: conn.sendall(answer(junk, KEY, req)))
    with pytest.raises(CheckpointError, match="does not start with the thinpipe state header") as e:
        fetch(joiner(), f2.url)
    one_line(e)
    f3 = fake(lambda conn, req: conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n" + junk))  # no Content-Length
    with pytest.raises(CheckpointError, match="gives no Content-Length"):
        fetch(joiner(), f3.url)
    f4 = fake(lambda conn, req: conn.sendall(junk))  # not HTTP at all
    with pytest.raises(CheckpointError, match="headers exceed|not HTTP"):
        fetch(joiner(), f4.url)


@pytest.mark.parametrize("where", ["body", "headers"])
def test_a_drip_feed_fails_at_the_one_deadline_of_the_whole_transfer(fake, where):
    stop = threading.Event()

    def drip(conn, req):
        if where == "body":
            conn.sendall(answer(b"", KEY, req, length=1 << 20))
        else:
            conn.sendall(b"HTTP/1.0 200 OK\r\n")
        while not stop.is_set():  # a byte every 0.1 s: no single read ever waits long
            conn.sendall(b"x")
            time.sleep(0.1)
    f = fake(drip)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError) as e:
        fetch(joiner(deadline=timedelta(seconds=1.5)), f.url, seconds=60)
    stop.set()
    took = time.perf_counter() - t0
    assert "did not arrive within 1.5 s (one deadline for the whole transfer)" in one_line(e)
    assert 1.4 < took < 4, took


def test_deep_json_is_refused_in_one_line():
    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(CheckpointError) as e:
        decode_state(MAGIC + len(deep).to_bytes(8, "big") + deep, 5, "peer")
    assert f"its JSON nests deeper than {MAX_DEPTH} levels" in one_line(e)
    # brackets inside strings are not nesting; a real state's tree passes
    ok = b'{"step": 5, "tree": {"a": "' + b"[" * 1000 + b'"}}'
    from safetensors.torch import save
    assert decode_state(MAGIC + len(ok).to_bytes(8, "big") + ok + save({}), 5, "peer") == {"a": "[" * 1000}
    assert decode_state(encode_state(5, STATE), 5, "peer")["torchft"] == STATE["torchft"]


def test_deep_json_signed_by_a_peer_is_refused_over_the_wire(fake):
    deep = b"{\"a\":" * 100_000
    f = fake(lambda conn, req: conn.sendall(answer(MAGIC + len(deep).to_bytes(8, "big") + deep, KEY, req)))
    with pytest.raises(CheckpointError, match="nests deeper than") as e:
        fetch(joiner(), f.url)
    one_line(e)


# ------------------------------------------------------------------------------- the server

def _handlers() -> int:
    return sum(t.name == "thinpipe-state-handler" for t in threading.enumerate())


def test_half_open_connections_neither_exhaust_the_server_nor_hold_its_threads(sender):
    sender.send_checkpoint([1], 5, STATE, timedelta(seconds=1))
    port = sender._server.server_address[1]
    held = []
    try:
        for _ in range(200):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /checkpoint/5 HTTP/1.0\r\nAuthoriz")  # and never the rest
            held.append(s)
        time.sleep(0.3)
        assert _handlers() <= recovery.SLOTS
        t0 = time.perf_counter()
        got = fetch(joiner(), sender.metadata())
        assert time.perf_counter() - t0 < 5
        assert got["torchft"] == STATE["torchft"]
        assert _handlers() <= recovery.SLOTS
    finally:
        for s in held:
            s.close()


def test_a_half_sent_request_is_closed_at_the_header_deadline(sender):
    s = socket.create_connection(("127.0.0.1", sender._server.server_address[1]), timeout=10)
    try:
        t0 = time.perf_counter()
        for _ in range(int(recovery.HEADER_DEADLINE_S * 20)):  # drip-feeding the request does not keep it open
            try:
                s.sendall(b"G")
            except OSError:
                break
            time.sleep(0.1)
        assert s.recv(100) == b""  # the server closed it without an answer
        assert recovery.HEADER_DEADLINE_S - 0.5 < time.perf_counter() - t0 < recovery.HEADER_DEADLINE_S + 2
    finally:
        s.close()


# --------------------------------------------------------------------- torchft's listeners

def test_the_lighthouse_and_a_replicas_manager_server_bind_the_jobs_address(monkeypatch):
    import torchft.manager as torchft_manager

    from thinpipe.commands.launch_elastic import start_lighthouse
    from thinpipe.config import load_config
    from thinpipe.engine.elastic_setup import manager_binds_to

    monkeypatch.delenv("THINPIPE_BIND_ADDR", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    before = {port for _, _, port in listening([os.getpid()])}
    lighthouse, address = start_lighthouse(load_config(None, []).elastic)
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", address), address
        with manager_binds_to("127.0.0.1"):
            # torchft 0.2.0's Manager passes bind=f"[::]:{port}"; built inside the context it binds the job's address
            server = torchft_manager.ManagerServer(
                replica_id="x", lighthouse_addr=address, hostname="127.0.0.1", bind="[::]:0",
                store_addr="127.0.0.1:1", world_size=1, heartbeat_interval=timedelta(seconds=1),
                connect_timeout=timedelta(seconds=5), quorum_retries=0)
        assert torchft_manager.ManagerServer.__name__ == "ManagerServer"  # put back
        try:
            new = [(a, p) for _, a, p in listening([os.getpid()]) if p not in before]
            assert len(new) >= 2 and all(a == "127.0.0.1" for a, _ in new), new
            assert server.address().startswith("http://127.0.0.1:")
        finally:
            server.shutdown()
    finally:
        lighthouse.shutdown()


# ----------------------------------------------------------------------------- a real job

@pytest.mark.dist
@pytest.mark.slow
def test_every_listener_of_an_elastic_job_is_on_loopback(tmp_path):
    from tests.integration.test_elastic import BASE

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("THINPIPE_BIND_ADDR", None)  # the launcher makes the job's key and gives it to its ranks
    p = subprocess.Popen([sys.executable, "-m", "thinpipe", "launch", "--elastic", "--", "train", "--out",
                          str(tmp_path / "job"), "--quiet", *BASE, "--set", "mesh.dp=2", "--set", "train.steps=40",
                          "--set", "link.pp_mbps=0.5"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    seen: dict[int, set[tuple[str, int]]] = {}
    try:
        while p.poll() is None:
            for pid, addr, port in listening(descendants(p.pid)):
                seen.setdefault(pid, set()).add((addr, port))
            time.sleep(0.3)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-3000:]
    wide = {pid: sorted(a for a in s if a[0] != "127.0.0.1") for pid, s in seen.items()}
    assert not any(wide.values()), wide
    # the launcher (the lighthouse) and every rank (4: recovery server, rank 0's store, stage 0's manager) listened
    assert p.pid in seen and len(seen) >= 5, seen
