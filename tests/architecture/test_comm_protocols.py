"""Every transport, group and work handle keeps to its interface (comm/protocols.py), so the rank code
that runs over the simulation's implementations runs unchanged over the real mesh's.

Each implementation is an instance of its ``runtime_checkable`` Protocol, defines every method of it
itself (none falls back on the Protocol's empty body), and each method takes the Protocol's
parameters with the same names, kinds, defaults and annotations, in order (anything more it takes
has a default); an interface change that misses one implementation fails here.
"""

import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from thinpipe.anchor.codec import _Recorder
from thinpipe.comm import inprocess
from thinpipe.comm.dist_group import DistGroup, _Timed
from thinpipe.comm.dist_transport import DistTransport
from thinpipe.comm.inprocess import InProcessGroup, LocalGroup, Mailbox
from thinpipe.comm.managed import ManagedGroup
from thinpipe.comm.meter import ByteMeter
from thinpipe.comm.protocols import Group, Transport, Work
from thinpipe.comm.staging import StagedWork
from thinpipe.comm.work import DONE, Done


def methods(proto) -> list[str]:
    return [n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")]


def test_the_interfaces_are_what_the_rank_code_calls():
    assert methods(Transport) == ["send", "recv", "flush"]
    assert methods(Group) == ["all_reduce", "all_gather"] and "size" in Group.__annotations__
    assert methods(Work) == ["wait", "is_completed"]


def check_signatures(impl: type, proto: type, returns: bool = True) -> None:
    """``returns=False``: an implementation may annotate a narrower return (an engine that always commits its step
    returns ``float`` where the protocol says ``float | None``)."""
    for name in methods(proto):
        want, got = getattr(proto, name), getattr(impl, name)
        assert got is not want, f"{impl.__name__}.{name} is the Protocol's empty body"
        w, g = inspect.signature(want), inspect.signature(got)
        wp, gp = list(w.parameters.values()), list(g.parameters.values())
        assert len(gp) >= len(wp), f"{impl.__name__}.{name}{g} takes fewer parameters than {proto.__name__}'s {w}"
        for a, b in zip(wp, gp):
            assert (a.name, a.kind, a.default) == (b.name, b.kind, b.default), \
                f"{impl.__name__}.{name}{g}: parameter {b.name} differs from {proto.__name__}.{name}{w}"
            if b.annotation is not inspect.Parameter.empty:
                assert a.annotation == b.annotation, f"{impl.__name__}.{name}: {b.name} is {b.annotation}"
        for extra in gp[len(wp):]:
            assert extra.default is not inspect.Parameter.empty or extra.kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD), \
                f"{impl.__name__}.{name}: its extra parameter {extra.name} needs a default"
        if returns and g.return_annotation is not inspect.Signature.empty:
            assert g.return_annotation == w.return_annotation, f"{impl.__name__}.{name} returns {g.return_annotation}"


class Manager:
    """What ``ManagedGroup`` asks of a torchft manager to be built and sized."""

    def num_participants(self) -> int:
        return 3


TRANSPORTS = {
    Mailbox: lambda: Mailbox(ByteMeter()),
    DistTransport: lambda: DistTransport(None, 0, ByteMeter(), key=bytes(32), label="test"),
}
GROUPS = {
    LocalGroup: LocalGroup,
    _Recorder: _Recorder,
    InProcessGroup: lambda: InProcessGroup(2, ByteMeter(), "dp"),
    DistGroup: lambda: DistGroup(None, 2, ByteMeter(), "dp"),
    ManagedGroup: lambda: ManagedGroup(Manager(), None, ByteMeter(), "dp"),
}
WORKS = {
    inprocess.Work: inprocess.Work,
    Done: lambda: DONE,
    _Timed: lambda: _Timed(DONE, 0.0),
    StagedWork: lambda: StagedWork(DONE, torch.zeros(1), torch.zeros(1)),
}


@pytest.mark.parametrize("impl", TRANSPORTS, ids=lambda c: c.__name__)
def test_every_transport_is_a_transport(impl):
    assert isinstance(TRANSPORTS[impl](), Transport)
    check_signatures(impl, Transport)


@pytest.mark.parametrize("impl", GROUPS, ids=lambda c: c.__name__)
def test_every_group_is_a_group(impl):
    group = GROUPS[impl]()
    assert isinstance(group, Group) and isinstance(group.size, int)
    check_signatures(impl, Group)


@pytest.mark.parametrize("impl", WORKS, ids=lambda c: c.__name__)
def test_every_work_is_a_work(impl):
    assert isinstance(WORKS[impl](), Work)
    check_signatures(impl, Work)


def test_torch_and_torchfts_work_handles_are_works():
    """A real group hands back torch.distributed's ``Work`` (torchft's are subclasses of it)."""
    from torchft.manager import _DummyWork, _ManagedWork

    for cls in (dist.Work, _DummyWork, _ManagedWork):
        assert issubclass(cls, Work), cls


def test_a_group_of_one_hands_back_the_one_finished_work():
    t = torch.ones(3)
    assert DistGroup(None, 1, ByteMeter(), None).all_reduce(0, t) is DONE
    work, out = DistGroup(None, 1, ByteMeter(), None).all_gather(0, t)
    assert work is DONE and torch.equal(out[0], t) and out[0] is not t
    lone = ManagedGroup(SimpleNamespace(num_participants=lambda: 1), None, ByteMeter(), None)
    assert lone.all_gather(0, t)[0] is DONE
    assert DONE.wait() is None and DONE.is_completed()


def test_the_finished_work_exists_once():
    from thinpipe.dp import streaming
    from thinpipe.rank import passes, stage_rank

    assert stage_rank.DONE is passes.DONE is streaming.DONE is DONE
