"""The authenticated wire (docs/security.md): a peer proves it holds the job key on every
point-to-point payload; a receiver decides what it allocates; listeners bind where the job lives."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from thinpipe.boundary.base import Payload
from thinpipe.comm.bind import bind_address, interface_of
from thinpipe.comm.header import Expect, PayloadError, decode_header, encode_header
from thinpipe.comm.jobkey import KEY_ENV, job_key, read_key_file, write_key_file
from thinpipe.comm.wire_auth import LinkAuth
from thinpipe.config import ConfigError

KEY, OTHER = bytes(range(32)), bytes(range(1, 33))


def _payload():
    g = torch.Generator().manual_seed(0)
    return Payload({"z": torch.randn(2, 3, 5, generator=g).to(torch.bfloat16),
                    "ids": torch.arange(6, dtype=torch.int16).view(2, 3), "mask": torch.rand(4, generator=g) > 0.5})


def _parts(p: Payload):
    return [t.contiguous().reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
            for t in p.tensors.values()]


def _receive(auth: LinkAuth, peer: int, ch: int, frame, body, expect: Expect) -> Payload:
    """What DistTransport.recv does with what gloo delivered (the same calls, without gloo)."""
    header, ticket = auth.open_header(peer, ch, frame)
    spec = decode_header(header)
    expect.check(spec, "test")
    sizes = [t.numel() * t.element_size() for t in (torch.empty(s, dtype=d) for _, d, s in spec)]
    assert [b.numel() for b in body] == auth.body_bytes(sizes)
    raws = auth.open_body(peer, ch, ticket, body, sizes)
    return Payload({n: (r.view(d) if d != torch.bool else r.to(torch.bool)).reshape(s)
                    for (n, d, s), r in zip(spec, raws)})


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_payload_round_trips_bit_exactly_and_a_replay_or_a_move_is_refused(encrypt):
    p = _payload()
    a, b = LinkAuth(KEY, "pp", 0, encrypt), LinkAuth(KEY, "pp", 1, encrypt)
    frame, body = a.seal(1, 1, encode_header(p), _parts(p))
    if encrypt:  # the tensors travel as one ciphertext, which is not the plain bytes
        assert len(body) == 1 and not torch.equal(body[0][:60], torch.cat(_parts(p))[:60])
    got = _receive(b, 0, 1, frame, body, Expect.like(p))
    assert all(torch.equal(got.tensors[k], v) and got.tensors[k].dtype == v.dtype for k, v in p.tensors.items())
    with pytest.raises(PayloadError, match="rank 0 .*failed authentication .*replayed"):
        _receive(b, 0, 1, frame, body, Expect.like(p))            # the same message again
    frame2, body2 = a.seal(1, 1, encode_header(p), _parts(p))
    with pytest.raises(PayloadError, match="failed authentication"):
        _receive(LinkAuth(KEY, "pp", 1, encrypt), 0, 2, frame2, body2, Expect.like(p))   # moved to another channel
    with pytest.raises(PayloadError, match="failed authentication"):
        _receive(LinkAuth(KEY, "eval", 1, encrypt), 0, 1, frame2, body2, Expect.like(p))  # to another transport


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_payload_made_without_the_key_or_tampered_with_is_refused_naming_the_peer(encrypt):
    p = _payload()
    stranger = LinkAuth(OTHER, "pp", 0, encrypt)
    frame, body = stranger.seal(1, 1, encode_header(p), _parts(p))
    with pytest.raises(PayloadError, match=r"from rank 0 \(channel 1\) failed authentication \(header\)"):
        _receive(LinkAuth(KEY, "pp", 1, encrypt), 0, 1, frame, body, Expect.like(p))
    frame, body = LinkAuth(KEY, "pp", 0, encrypt).seal(1, 1, encode_header(p), _parts(p))
    body = [b.clone() for b in body]
    body[0][3] ^= 1                                             # one bit of the data flipped on the way
    with pytest.raises(PayloadError, match="failed authentication .*body"):
        _receive(LinkAuth(KEY, "pp", 1, encrypt), 0, 1, frame, body, Expect.like(p))
    frame, body = LinkAuth(KEY, "pp", 0, encrypt).seal(1, 1, encode_header(p), _parts(p))
    forged = frame.clone()
    forged[5] += 1                                              # a shape changed in the header
    with pytest.raises(PayloadError, match="failed authentication \\(header\\)"):
        _receive(LinkAuth(KEY, "pp", 1, encrypt), 0, 1, forged, body, Expect.like(p))


def test_the_receiver_refuses_what_it_does_not_expect_before_allocating():
    huge = torch.empty(0)
    header = encode_header(Payload({"x": huge})).clone()
    header[2] = 2 ** 33                                         # claims 8 GiB in a (2^31, 4) float32
    header[3 + 2], header[3 + 3] = 2 ** 31, 1
    header[4] = 2
    spec = decode_header(header)
    with pytest.raises(PayloadError, match="8589934592 bytes where at most 2048 are expected; refused before"):
        Expect(max_bytes=2048).check(spec, "Activation from rank 0")
    foreign = decode_header(encode_header(Payload({"x": torch.zeros(3, 7, dtype=torch.float64)})))
    with pytest.raises(PayloadError, match="float64, which this receiver never accepts"):
        Expect(max_bytes=10 ** 6).check(foreign, "Activation from rank 0")
    exact = Expect.exactly({"x": ((2, 4, 8), torch.float32)})
    with pytest.raises(PayloadError, match=r"sent x \(3, 7\) float32 where x \(2, 4, 8\) float32 was expected"):
        exact.check(decode_header(encode_header(Payload({"x": torch.zeros(3, 7)}))), "TiedGrad from rank 1")
    exact.check(decode_header(encode_header(Payload({"x": torch.zeros(2, 4, 8)}))), "TiedGrad from rank 1")
    bad_name = encode_header(Payload({"x": torch.zeros(1)})).clone()
    bad_name[3 + 2 + 6] = int.from_bytes(b"\xff\xfe\xfd\x00\x00\x00\x00\x00", "little", signed=True)
    with pytest.raises(PayloadError, match="not UTF-8"):
        decode_header(bad_name)


def test_simulated_receivers_check_the_same_bounds():
    """The in-process mailbox applies the receiver's Expect too, so every simulated run (the whole
    suite) shows that each kind's bound admits what its sender sends; here: one it would not."""
    from thinpipe.comm.inprocess import Mailbox
    from thinpipe.comm.meter import ByteMeter
    from thinpipe.comm.tags import Activation

    box = Mailbox(ByteMeter())
    box.send(Activation(0, 0, 0), Payload({"x": torch.zeros(4, 4)}), "pp_fwd")
    with pytest.raises(PayloadError, match="64 bytes where at most 32"):
        box.recv(Activation(0, 0, 0), Expect(max_bytes=32))


def test_job_key_files_are_private_and_checked(tmp_path, monkeypatch):
    path = write_key_file(tmp_path / "job.key")
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(read_key_file(path)) == 32
    with pytest.raises(ConfigError, match="never overwritten"):
        write_key_file(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="can be read by other users: chmod 600"):
        read_key_file(path)
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match="is not a job key"):
        read_key_file(bad)
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match="needs a job key .*thinpipe keygen"):
        job_key("--engine dist")


def test_listeners_bind_loopback_for_one_machine_and_ask_otherwise(monkeypatch):
    monkeypatch.delenv("THINPIPE_BIND_ADDR", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert bind_address() == "127.0.0.1" and interface_of("127.0.0.1") == "lo"
    monkeypatch.setenv("MASTER_ADDR", "10.7.0.1")
    with pytest.raises(ConfigError, match="spans machines: set \\$THINPIPE_BIND_ADDR"):
        bind_address()
    monkeypatch.setenv("THINPIPE_BIND_ADDR", "10.7.0.2x")
    with pytest.raises(ConfigError, match="is not an IPv4 address"):
        bind_address()
    monkeypatch.setenv("THINPIPE_BIND_ADDR", "0.0.0.0")  # asked for in so many words
    assert bind_address() == "0.0.0.0"
    with pytest.raises(ConfigError, match="no interface of this machine has the address 192.0.2.1"):
        interface_of("192.0.2.1")


OUTSIDER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from thinpipe.boundary.base import Payload
    from thinpipe.comm.meter import ByteMeter
    from thinpipe.comm.dist_transport import DistTransport
    from thinpipe.comm.header import Expect, PayloadError, encode_header
    from thinpipe.comm.rendezvous import init_gloo
    from thinpipe.comm.tags import Activation
    from thinpipe.layout import MeshLayout
    rank, mode = int(os.environ["RANK"]), sys.argv[1]
    init_gloo(30)
    key = bytes(range(1, 33)) if rank == 0 and mode == "stranger" else bytes(range(32))
    t = DistTransport(MeshLayout(1, 2), rank, ByteMeter(), key=key, label="pp")
    p = Payload({"x": torch.arange(8, dtype=torch.float32)})
    if rank == 0:
        # what DistTransport.send posts, sent by hand so that an on-path attacker's copy can follow it
        frame, body = t.auth.seal(1, 1, encode_header(p), [p.tensors["x"].view(torch.uint8)])
        for _ in range(2 if mode == "replay" else 1):
            for part in [frame, *body]:
                dist.send(part, 1, tag=1)
    else:
        for attempt in range(2 if mode == "replay" else 1):
            try:
                got = t.recv(Activation(0, 0, 0), Expect.like(p))
                print("accepted", got.tensors["x"].tolist(), flush=True)
            except PayloadError as e:
                print("refused:", e, flush=True)
                dist.recv(torch.empty(32, dtype=torch.uint8), 0, tag=1)  # drain the body it never read
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["stranger", "replay"])
def test_a_real_rank_refuses_a_strangers_payload_and_a_replayed_one(tmp_path, mode):
    """Over gloo: a process that knows the rendezvous but not the key cannot inject a payload, and
    a valid payload sent a second time (an on-path replay) is refused; both in one line naming the peer."""
    outs = _two_processes(tmp_path, OUTSIDER, mode)
    lines = [ln for ln in outs[1].splitlines() if ln.startswith(("accepted", "refused"))]
    refusal = ("refused: a payload from rank 0 (channel 1) failed authentication (header): it was injected, replayed "
               "or sent with another job key; refused")
    if mode == "stranger":
        assert lines == [refusal]
    else:
        assert lines == ["accepted [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]", refusal]


GATHER = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from thinpipe.comm.meter import ByteMeter
    from thinpipe.comm.dist_group import DistGroup
    from thinpipe.comm.header import PayloadError
    from thinpipe.comm.rendezvous import init_gloo
    rank = int(os.environ["RANK"])
    init_gloo(30)
    if rank == 0:
        try:
            DistGroup(None, 2, ByteMeter(), None).all_gather(0, torch.zeros(16, dtype=torch.int8))
            print("allocated", flush=True)
        except PayloadError as e:
            print("refused:", e, flush=True)
    else:  # a member that claims 2^40 elements: the lengths step of gather_1d, then nothing
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(lengths, torch.tensor([2 ** 40]))
    dist.barrier()
    dist.destroy_process_group()
""")


def _two_processes(tmp_path, source: str, *args: str) -> list[str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "rank.py"
    script.write_text(source)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**env, "RANK": str(r)}) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return outs


@pytest.mark.dist
def test_an_all_gather_refuses_a_member_that_claims_more_than_it_may_send(tmp_path):
    outs = _two_processes(tmp_path, GATHER)
    assert ("refused: all-gather: member 1 of the group claims 1099511627776 elements, at most 16 are expected; "
            "refused before allocating them") in outs[0].splitlines()


TINY = ["--set", "data.name=synthetic", "--set", "train.batch_size=2", "--set", "train.seq_len=32",
        "--set", "train.microbatches=2", "--set", "train.lr=1e-3", "--set", "model.name=tiny-llama"]
ANCHOR = ["--set", "train.steps=6", "--set", "mesh.pp=2", "--set", "mesh.dp=2", "--set", "mesh.anchor=1",
          "--set", "boundary.kind=mask", "--set", "dp.kind=powersgd", "--set", "dp.start_step=1",
          "--set", "anchor.staleness=2", "--set", "anchor.every=1", "--set", "anchor.push_rank=2"]


def _launch(nproc: int, out, args, **env_extra):
    return subprocess.Popen([sys.executable, "-m", "thinpipe", "launch", "--nproc", str(nproc), "--", "train", "--out",
                             str(out), "--quiet", *args], env={**os.environ, "OMP_NUM_THREADS": "1", **env_extra},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.dist
def test_a_sealed_run_equals_the_plain_one_bitwise_and_every_listener_is_on_loopback(tmp_path):
    """``wire.encrypt = true`` on the anchor case (fast PP links, the eval transport, the anchor's
    pull, push and row links): the same losses, held-out loss, bytes and final weights as the plain
    run; while the job runs, each socket its processes listen on is bound to 127.0.0.1."""
    from tests.listeners import descendants, listening
    from thinpipe.checkpoint import load_part, sets

    runs = {}
    seen: set[tuple[str, int]] = set()
    for name, extra in (("plain", []), ("sealed", ["--set", "wire.encrypt=true"])):
        out = tmp_path / name
        proc = _launch(6, out, [*TINY, *ANCHOR, *extra])
        while proc.poll() is None:
            seen |= {(addr, port) for _, addr, port in listening(descendants(proc.pid))}
            time.sleep(0.05)  # a look every 50 ms, not a core spinning beside the job's ranks
        assert proc.returncode == 0, proc.stderr.read()[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        folder = sets(out / "checkpoint")[0][1]
        weights = [load_part(folder, f"rank{r}") for r in range(6)]
        runs[name] = ([r["loss"] for r in rows], summary["final_val_loss"],
                      {k: v for k, v in summary.items() if k.endswith("_bytes")}, weights)
    plain, sealed = runs["plain"], runs["sealed"]
    assert sealed[:3] == plain[:3]
    assert all(_tensors_equal(a, b) for a, b in zip(plain[3], sealed[3]))  # every rank's whole saved state
    assert seen and {addr for addr, _ in seen} == {"127.0.0.1"}, seen


def _tensors_equal(a, b) -> bool:
    """Equal bitwise, tensors and values, except measured seconds (keys ending in ``_s``: wall time)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _tensors_equal(a[k], b[k]) for k in a if not str(k).endswith("_s"))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b
