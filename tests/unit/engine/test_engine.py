"""Engine invariants: packed documents are isolated, runs repeat bitwise, bf16 trains, schedules are valid."""

import pytest
import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.rank.schedule import gpipe, one_f_one_b, serial_order


def test_packed_documents_do_not_see_each_other():
    """A document's loss in a packed row equals its loss alone in a row (block-diagonal attention,
    positions restarting per document)."""
    model = tiny_model("llama")
    mesh = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 512, (1, 10), generator=g), torch.randint(0, 512, (1, 6), generator=g)

    def row(parts, segs):
        ids = torch.cat(parts, 1)
        return {"input_ids": ids, "labels": ids.clone(), "segment_ids": torch.cat(segs, 1)}

    # Labels of the first token of b are dropped in the packed row (they'd be predicted from a).
    packed = row([a, b], [torch.zeros(1, 10, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)])
    packed["labels"][0, 10] = -100
    alone_a = row([a], [torch.zeros(1, 10, dtype=torch.long)])
    alone_b = row([b], [torch.zeros(1, 6, dtype=torch.long)])
    la, na = mesh.eval_loss(alone_a)
    lb, nb = mesh.eval_loss(alone_b)
    lp, n_p = mesh.eval_loss(packed)
    assert n_p == na + nb
    assert lp == pytest.approx(la + lb, rel=1e-5)


def test_runs_repeat_bitwise():
    kw = dict(model__name="tiny-qwen2", mesh__pp=2, mesh__dp=2, boundary__kind="mask", train__batch_size=2,
              train__lr=1e-3, train__microbatches=2)
    losses = []
    for _ in range(2):
        mesh = SimMesh(tiny_model("qwen2"), config(**kw))
        losses.append([mesh.train_step([tiny_batch(2, seed=s), tiny_batch(2, seed=10 + s)]) for s in range(3)])
    assert losses[0] == losses[1]


def test_bfloat16_autocast_trains_and_halves_wire_bytes():
    model = tiny_model("llama")
    f32 = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2, train__batch_size=2, train__lr=1e-3))
    bf16 = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2, train__batch_size=2, train__lr=1e-3,
                                 train__dtype="bfloat16"))
    batch = tiny_batch(2)
    l32, l16 = f32.train_step([batch]), bf16.train_step([batch])
    assert abs(l32 - l16) < 0.05 * l32
    assert bf16.meter.totals["pp_fwd"] * 2 == f32.meter.totals["pp_fwd"]
    assert all(p.dtype == torch.float32 for st in bf16.replicas[0] for p in st.parameters())  # fp32 master weights


def test_dp_replicas_see_different_data_and_stay_identical():
    mesh = SimMesh(tiny_model("llama"), config(model__name="tiny-llama", mesh__pp=2, mesh__dp=3, train__batch_size=2,
                                               train__lr=1e-3))
    mesh.train_step([tiny_batch(2, seed=s) for s in range(3)])
    for s in range(2):
        ref = mesh.replicas[0][s].state_dict()
        for r in (1, 2):
            for k, v in mesh.replicas[r][s].state_dict().items():
                assert torch.equal(v, ref[k]), (r, s, k)
    # ring all-reduce accounting: each replica sends 2 (n-1)/n of the gradient bytes
    n_params = sum(p.numel() for st in mesh.replicas[0] for p in st.parameters())
    assert mesh.meter.totals["dp"] == 3 * (2 * 2 * n_params * 4 // 3)


def test_dp_average_equals_big_batch_single_replica():
    """dp=2 with batches A, B gives the same gradient as dp=1 on A+B when both halves hold equally
    many loss tokens (each replica normalises by its own token count)."""
    model = tiny_model("llama")
    a, b = tiny_batch(2, seed=1), tiny_batch(2, seed=2)
    both = {k: torch.cat([a[k], b[k]]) for k in a}
    m2 = SimMesh(model, config(model__name="tiny-llama", mesh__dp=2, train__batch_size=2))
    m1 = SimMesh(model, config(model__name="tiny-llama", train__batch_size=4))
    m2.forward_backward([a, b])
    m1.forward_backward([both])
    m2.sync_gradients()
    for p2, p1 in zip(m2.replicas[0][0].parameters(), m1.replicas[0][0].parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
@pytest.mark.parametrize("stages,mbs", [(1, 1), (2, 3), (4, 2), (4, 8)])
def test_schedules_cover_every_action_once_in_dependency_order(build, stages, mbs):
    rows = build(stages, mbs)
    for row in rows:
        assert sorted(row) == sorted([("F", m) for m in range(mbs)] + [("B", m) for m in range(mbs)])
        assert [m for k, m in row if k == "B"] == list(range(mbs))  # backward in microbatch order
    order = serial_order(rows)
    assert len(order) == 2 * stages * mbs


def test_one_f_one_b_limits_in_flight_microbatches():
    for s, row in enumerate(one_f_one_b(4, 8)):
        in_flight, peak = 0, 0
        for kind, _ in row:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == 4 - s  # at most P - s activations held, vs all M under GPipe
