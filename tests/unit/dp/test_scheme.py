"""The DP scheme interface (thinpipe/dp/scheme.py, kinds.py, registry.py): one registry, each scheme describes
itself, and what it says matches what it does."""

import pytest
import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.config import DP_KINDS, ConfigError
from thinpipe.dp.kinds import BUILTIN_KINDS, DPKind, describe, kinds
from thinpipe.dp.registry import BUILTIN, build_scheme, scheme_class
from thinpipe.dp.scheme import DPScheme
from thinpipe.engine.sim_mesh import SimMesh

KW = dict(model__name="tiny-llama", mesh__pp=2, mesh__dp=2, train__batch_size=2, train__lr=1e-3)


def test_every_builtin_kind_is_described_implemented_and_accepted_by_the_config():
    assert tuple(BUILTIN) == tuple(BUILTIN_KINDS) == DP_KINDS
    for kind, scheme in BUILTIN.items():
        assert issubclass(scheme, DPScheme) and issubclass(scheme, BUILTIN_KINDS[kind]) and scheme.kind == kind
        assert describe(kind) is BUILTIN_KINDS[kind] and scheme_class(kind) is scheme
    with pytest.raises(ValueError, match="dp.kind = 'nope' is unknown"):
        describe("nope")
    with pytest.raises(ConfigError, match="dp.kind = 'nope' is unknown"):
        config(dp__kind="nope")


def test_the_descriptions_the_planner_reads():
    mats = [(64, 64), (128, 64)]
    d = config(dp__kind="diloco", dp__inner_steps=7, dp__rank=2).dp
    assert describe("allreduce").wire_ratio(d, mats) == 1.0 and describe("allreduce").sync_interval(d) == 1
    assert describe("diloco").sync_interval(d) == 7 and describe("streaming-diloco").sync_interval(d) == 7
    assert describe("diloco").wire_ratio(d, mats) == pytest.approx((2 * 128 + 2 * 192) / (64 * 64 + 128 * 64))
    assert describe("powersgd").wire_ratio(config(dp__kind="powersgd").dp, mats) == \
        pytest.approx((4 * 128 + 4 * 192) / (64 * 64 + 128 * 64))
    assert [describe(k).state_bytes_per_param(d) for k in DP_KINDS] == [0, 0, 8, 8]
    assert [describe(k).replicas_agree_every_step for k in DP_KINDS] == [True, True, False, False]
    offers = [o.settings() for k in kinds().values() for o in k.offers([(0, 1.0), (4, 10.0)], [1, 10])]
    assert offers == [{"dp.kind": "allreduce"}, {"dp.kind": "powersgd", "dp.rank": "4"},
                      {"dp.kind": "diloco", "dp.rank": "0", "dp.inner_steps": "10"},
                      {"dp.kind": "diloco", "dp.rank": "4", "dp.inner_steps": "10"}]
    assert DPKind.offers([(0, 1.0)], [1]) == []


@pytest.mark.parametrize("kind", DP_KINDS)
def test_replicas_agree_exactly_when_the_scheme_says(kind):
    mesh = SimMesh(tiny_model("llama"), config(**KW, dp__kind=kind, dp__inner_steps=2, dp__fragments=1))
    for step in range(4):
        mesh.train_step([tiny_batch(2, seed=10 * step), tiny_batch(2, seed=10 * step + 1)])
        schemes = [rk.dp_scheme for rk in mesh.all_ranks()]
        assert all(type(s) is BUILTIN[kind] for s in schemes)
        agree = all(torch.equal(a, b) for s in range(2) for a, b in
                    zip(mesh.replicas[0][s].parameters(), mesh.replicas[1][s].parameters()))
        if schemes[0].agree_after(step):
            assert agree, step
        elif kind != "streaming-diloco":  # its mixing may leave them equal by chance: only diloco must differ
            assert not agree, step


def test_build_scheme_binds_the_group_and_reads_its_size_when_it_runs():
    class Group:
        size = 1

    d = config(dp__kind="powersgd").dp
    s = build_scheme(d, lambda: [], Group(), 0, 3)
    assert list(s.sync_grads(0, {"w": torch.ones(4, 4)})) == [] and s.state.step == 0  # a group of one: no average
    assert s.state_dict()["psgd"]["step"] == 0 and list(s.repost()) == []
