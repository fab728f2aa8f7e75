"""The anchor links' payloads (anchor/codec.py): what is sent is what is metered, and what a fast
replica rebuilds is exactly what the anchor's PowerSGD compression produced."""

import torch

from thinpipe.anchor.codec import decode_push, encode_pull, encode_push, load_pull
from thinpipe.comm.inprocess import LocalGroup, drive_lockstep
from thinpipe.dp.powersgd import PowerSGDState, powersgd_average, wire_numel


def grads():
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(32, 16, generator=g), "b1": torch.randn(16, generator=g),
            "w2": torch.randn(4, 3, generator=g), "w3": torch.randn(24, 8, 2, generator=g)}


def test_dense_push_round_trips_bitwise_and_its_bytes_are_the_numel():
    g = grads()
    push = encode_push(g, None, None)
    out = decode_push(push, g, 0)
    assert all(torch.equal(out[n], g[n]) for n in g)
    assert sum(t.nbytes for t in push.values()) == sum(t.numel() for t in g.values()) * 4


def test_compressed_push_rebuilds_what_in_place_powersgd_computes_with_its_error_feedback():
    g = grads()
    sender, reference = PowerSGDState(rank=2, start_step=0, seed=3), PowerSGDState(rank=2, start_step=0, seed=3)
    for _ in range(3):  # warm-started Q and error feedback carry over between pushes
        push = encode_push(g, sender, None)
        out = decode_push(push, g, 2)
        expect = {n: t.clone() for n, t in g.items()}
        drive_lockstep([powersgd_average(reference, expect, LocalGroup(), 0, 1)])
        assert all(torch.equal(out[n], expect[n]) for n in g)
        assert sum(t.nbytes for t in push.values()) == wire_numel({n: tuple(t.shape) for n, t in g.items()},
                                                                  PowerSGDState(rank=2, start_step=0)) * 4
    assert set(sender.error) == {"w1", "w3"}  # w2 (4 x 3) and the vector are sent dense


def test_a_bf16_wire_halves_the_bytes_and_rounds_the_values():
    g = grads()
    push = encode_push(g, None, torch.bfloat16)
    out = decode_push(push, g, 0)
    assert sum(t.nbytes for t in push.values()) == sum(t.numel() for t in g.values()) * 2
    assert all(torch.equal(out[n], g[n].to(torch.bfloat16).float()) for n in g)


def test_a_pull_loads_the_weights_and_a_wrong_size_is_an_error():
    src = [torch.randn(3, 4), torch.randn(5)]
    dst = [torch.zeros(3, 4), torch.zeros(5)]
    load_pull(dst, encode_pull(src, None))
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    try:
        load_pull([torch.zeros(3, 4)], encode_pull(src, None))
    except ValueError as e:
        assert "17 values" in str(e) and "this stage has 12" in str(e)
    else:
        raise AssertionError("a pull of the wrong size was accepted")
