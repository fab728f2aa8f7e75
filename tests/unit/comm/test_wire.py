"""Payloads on real links: header round trip, malformed input refused, shaping, and a gloo exchange."""

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from thinpipe.boundary.base import Payload
from thinpipe.comm.header import Expect, PayloadError, decode_header, encode_header
from thinpipe.comm.shaped import DueQueue, ShapedLink


def sample_payload():
    return Payload({"z": torch.randn(2, 3, 5).to(torch.bfloat16), "ids": torch.arange(6, dtype=torch.int16).view(2, 3),
                    "codes": torch.randint(0, 256, (6, 2, 4)).to(torch.uint8), "scale": torch.rand(6)})


def test_header_round_trip_and_malformed_headers_are_refused():
    p = sample_payload()
    spec = decode_header(encode_header(p))
    assert spec == [(n, t.dtype, tuple(t.shape)) for n, t in p.tensors.items()]
    bad = encode_header(p).clone()
    bad[0] = 1
    with pytest.raises(PayloadError, match="magic"):
        decode_header(bad)
    bad = encode_header(p).clone()
    bad[2] += 1                                   # claims one byte more than its tensors hold
    with pytest.raises(PayloadError, match="inconsistent"):
        decode_header(bad)
    bad = encode_header(p).clone()
    bad[3] = 99                                   # unknown dtype code
    with pytest.raises(PayloadError, match="dtype"):
        decode_header(bad)


def test_shaped_link_delivers_no_faster_than_size_over_rate():
    link = ShapedLink(rate_mbps=8.0, latency_ms=5.0)
    assert link.delivery_time(1_000_000, 0.0) == pytest.approx(1.005)   # 1 MB at 8 Mbit/s = 1 s, + 5 ms
    assert link.delivery_time(500_000, 10.0) == pytest.approx(10.505)   # idle link: 0.5 s + 5 ms
    # two messages handed over at once: the second's transfer queues behind the first's, but not
    # behind its latency (both are in flight at once, as on a real link)
    assert link.delivery_time(1_000_000, 20.0) == pytest.approx(21.005)
    assert link.delivery_time(1_000_000, 20.0) == pytest.approx(22.005)


def test_due_queue_delivers_at_due_times_earliest_first_never_early():
    delivered = []
    q = DueQueue(lambda item: delivered.append((item, time.perf_counter())))
    t0 = time.perf_counter()
    q.put(t0 + 0.6, "late link")
    q.put(t0 + 0.2, "a1")          # another link's messages, due earlier: not held behind "late link"
    q.put(t0 + 0.3, "a2")
    q.put(t0 + 0.3, "a3")          # a tie keeps hand-over order
    q.join()
    assert [item for item, _ in delivered] == ["a1", "a2", "a3", "late link"]
    due = {"a1": 0.2, "a2": 0.3, "a3": 0.3, "late link": 0.6}
    for item, at in delivered:
        assert at - t0 >= due[item]                 # never before its due time
        assert at - t0 < due[item] + 1.0            # nor held long after it (slack: a loaded machine)
    assert q.unfinished == 0
    q.close()


def test_due_queue_back_to_back_messages_overlap_their_latency():
    """Two 0.1 s messages on a link with 2 s latency: the second arrives at 2.2 s (0.2 s of
    transfer + one latency), not 4.2 s as a sender that sleeps out each latency would give."""
    link = ShapedLink(rate_mbps=8.0, latency_ms=2000.0)
    delivered = []
    q = DueQueue(lambda item: delivered.append(time.perf_counter()))
    t0 = link.clock()
    for _ in range(2):
        q.put(link.delivery_time(100_000, link.clock()), None)
    q.join()
    assert delivered[1] - t0 >= 2.2
    assert delivered[1] - t0 < 3.2


def test_due_queue_keeps_a_delivery_error_for_the_owner():
    delivered = []

    def deliver(item):
        if item == "bad":
            raise OSError("peer gone")
        delivered.append(item)
    q = DueQueue(deliver)
    q.put(time.perf_counter(), "bad")
    q.put(time.perf_counter(), "good")   # the thread goes on after an error
    q.join()
    assert isinstance(q.error, OSError) and delivered == ["good"]
    q.close()
    with pytest.raises(RuntimeError, match="closed"):
        q.put(time.perf_counter(), "after close")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
def test_two_gloo_ranks_exchange_payloads_bit_exactly_and_shaped(tmp_path):
    script = textwrap.dedent("""
        import sys, time, torch, torch.distributed as dist
        from thinpipe.boundary.base import Payload
        from thinpipe.comm.meter import ByteMeter
        from thinpipe.comm.dist_transport import DistTransport
        from thinpipe.comm.header import Expect
        from thinpipe.comm.shaped import ShapedLink
        from thinpipe.comm.tags import Activation, Gradient
        from thinpipe.layout import MeshLayout
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2)
        torch.manual_seed(0)
        p = Payload({"z": torch.randn(2, 3, 5).to(torch.bfloat16), "ids": torch.arange(6, dtype=torch.int16).view(2, 3),
                     "mask": torch.rand(4) > 0.5, "big": torch.randn(250_000)})
        meter = ByteMeter()
        link = ShapedLink(rate_mbps=80.0)
        t = DistTransport(MeshLayout(1, 2), rank, meter, lambda axis, peer: link if axis == "pp_fwd" else None,
                          key=bytes(32), label="test")
        F, B = Activation(0, 0, 0), Gradient(0, 0, 0)
        if rank == 0:
            t0 = time.perf_counter()
            t.send(F, p, "pp_fwd")
            handed = time.perf_counter() - t0   # the sender thread holds the message, not the caller
            t.flush()
            back = t.recv(B, Expect(max_bytes=24))
            print("elapsed", time.perf_counter() - t0, "bytes", meter.totals["pp_fwd"], "handed", handed, flush=True)
            assert torch.equal(back.tensors["g"], torch.full((3,), 7, dtype=torch.int64))
        else:
            got = t.recv(F, Expect.like(p))
            for k, v in p.tensors.items():
                assert got.tensors[k].dtype == v.dtype and torch.equal(got.tensors[k], v), k
            t.send(B, Payload({"g": torch.full((3,), 7, dtype=torch.int64)}), "pp_bwd")
            t.flush()
        dist.destroy_process_group()
    """)
    path = tmp_path / "rank.py"
    path.write_text(script)
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(path), str(r), port], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    line = outs[0][0].split()
    elapsed, nbytes, handed = float(line[1]), int(line[3]), float(line[5])
    assert nbytes == 2 * 3 * 5 * 2 + 6 * 2 + 4 + 250_000 * 4
    assert elapsed >= nbytes * 8 / 80e6          # ~0.1 s at 80 Mbit/s: never faster than size / rate
    assert handed < 0.5 * nbytes * 8 / 80e6      # and the sender was free to compute meanwhile


def test_both_transports_refuse_a_message_without_a_typed_tag():
    """A tag that is not one of comm/tags.py's types fails in the simulation as on the real mesh
    (the real transport checks before it touches torch.distributed)."""
    from thinpipe.comm.dist_transport import DistTransport
    from thinpipe.comm.inprocess import Mailbox
    from thinpipe.comm.meter import ByteMeter
    from thinpipe.comm.tags import Activation
    from thinpipe.layout import MeshLayout

    payload = Payload({"x": torch.zeros(2)})
    box = Mailbox(ByteMeter())
    real = DistTransport(MeshLayout(1, 2), 0, ByteMeter(), key=bytes(32), label="test")
    any_ = Expect(max_bytes=8)
    for bad in [(0, "F", 0, 0), "F", ("pull",)]:
        for call in (lambda: box.send(bad, payload, "pp_fwd"), lambda: box.recv(bad, any_),
                     lambda: real.send(bad, payload, "pp_fwd"), lambda: real.recv(bad, any_)):
            with pytest.raises(TypeError, match="unknown message tag"):
                call()
    box.send(Activation(0, 0, 0), payload, "pp_fwd")
    assert box.recv(Activation(0, 0, 0), any_) is payload
    with pytest.raises(ValueError, match="not an end"):
        Activation(0, 0, 0).peer(MeshLayout(1, 3), 2)  # boundary 0 joins ranks 0 and 1
