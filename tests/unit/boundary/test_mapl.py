"""MAPL boundaries in the mesh (MAPL §3.2-3.3): equivalences, ownership sync, bytes, manifold."""

import pytest
import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.optim.stiefel import stiefel_error

H, V = 64, 512


def mapl_cfg(**kw):
    base = dict(model__name="tiny-llama", mesh__pp=4, boundary__kind="mapl", boundary__rank=16,
                train__batch_size=2, train__seq_len=16, train__microbatches=2, train__lr=1e-3)
    return config(**{**base, **kw})


def test_full_rank_static_offset_is_the_dense_model():
    """r = d makes A A^T = I, and static offsets re-add exactly what the sender removed: the MAPL
    mesh computes the dense model's loss."""
    model = tiny_model()
    batch = tiny_batch()
    dense = SimMesh(model, config(model__name="tiny-llama", mesh__pp=4))
    full = SimMesh(model, mapl_cfg(boundary__rank=H, boundary__offset="static"))
    a, n = dense.eval_loss(batch)
    b, m = full.eval_loss(batch)
    assert n == m and abs(a - b) < 1e-4 * abs(a)


def reference_loss(mesh, batch):
    """The MAPL model computed in one graph, with one shared A per boundary (no copies, no wire)."""
    from thinpipe.rank.context import make_contexts
    stages, bounds = mesh.replicas[0], mesh.boundaries
    ctx = make_contexts(batch, 1, 0, 0)[0]
    x = ctx.input_ids
    for s, st in enumerate(stages):
        if s:
            b = bounds[s - 1]
            off = b.sender_offset(ctx.input_ids)
            z = (x - off) @ b.projector.A
            x = z @ b.projector.A.T + b.offset(ctx.input_ids)
        x = st(x, ctx)
    return x


def test_split_mesh_equals_one_graph_and_owner_gets_both_halves_of_the_gradient():
    torch.manual_seed(0)
    model = tiny_model()
    batch = tiny_batch(batch_size=2)
    mesh = SimMesh(model, mapl_cfg(train__microbatches=1))
    ref = SimMesh(model, mapl_cfg(train__microbatches=1))
    loss = mesh.forward_backward([batch])
    mesh.sync_boundary_grads()
    ref_loss = reference_loss(ref, batch)
    ref_loss.backward()
    assert abs(loss - float(ref_loss.detach())) < 1e-5
    for b, rb in zip(mesh.boundaries, ref.boundaries):
        assert torch.allclose(b.projector.A.grad, rb.projector.A.grad, atol=1e-6)
        assert torch.allclose(b.offset.small.grad, rb.offset.small.grad, atol=1e-6)


def test_payload_and_projector_sync_bytes_equal_the_formula():
    model = tiny_model()
    cfg = mapl_cfg()
    mesh = SimMesh(model, cfg)
    mesh.train_step([tiny_batch(batch_size=2)])
    tokens_per_mb = 1 * 16
    fwd, bwd = mesh.boundaries[0].expected_bytes(tokens_per_mb, 4)
    assert fwd == tokens_per_mb * (16 * 4 + 2) and bwd == tokens_per_mb * 16 * 4  # r fp32 + int16 ids
    links = 3 * 2  # boundaries x microbatches
    t = mesh.meter.totals
    assert t["pp_fwd"] == links * fwd and t["pp_bwd"] == links * bwd
    assert t["pp_params"] == 3 * 2 * H * 16 * 4  # dA up + A down per boundary per step


def test_spel_training_keeps_projectors_on_the_manifold_and_copies_in_sync():
    model = tiny_model()
    mesh = SimMesh(model, mapl_cfg())
    A0 = [b.projector.A.detach().clone() for b in mesh.boundaries]
    losses = [mesh.train_step([tiny_batch(batch_size=2, seed=0)]) for _ in range(12)]
    assert losses[-1] < losses[0]
    for b, a0 in zip(mesh.boundaries, A0):
        assert stiefel_error(b.projector.A.detach()) < 1e-4
        assert not torch.allclose(b.projector.A, a0)
        assert torch.equal(b.A_copy.detach(), b.projector.A.detach())   # receiver copy == owner's


@pytest.mark.parametrize("optim", ["fixed", "muon"])
def test_table5_projector_ablations(optim):
    mesh = SimMesh(tiny_model(), mapl_cfg(boundary__projector_optim=optim, boundary__projector_lr_scale=1.0))
    A0 = mesh.boundaries[0].projector.A.detach().clone()
    for _ in range(5):
        mesh.train_step([tiny_batch(batch_size=2)])
    A = mesh.boundaries[0].projector.A.detach()
    if optim == "fixed":
        assert torch.equal(A, A0) and mesh.meter.totals["pp_params"] == 0
    else:   # unconstrained updates leave St(d, r) (the failure mode of App. C)
        assert stiefel_error(A) > 1e-2


def test_dp_replicas_keep_identical_projectors():
    mesh = SimMesh(tiny_model(), mapl_cfg(mesh__dp=2))
    for step in range(3):
        mesh.train_step([tiny_batch(batch_size=2, seed=step), tiny_batch(batch_size=2, seed=10 + step)])
    a, b = (mesh.replica_boundaries[r][1].projector.A for r in range(2))
    assert torch.equal(a, b)


def test_architectural_kinds_reject_anchor_and_partial_masks():
    from thinpipe.config import ConfigError
    with pytest.raises(ConfigError, match="part of the model"):
        mapl_cfg(mesh__anchor=1)
    with pytest.raises(ConfigError, match="boundary.masked"):
        mapl_cfg(boundary__masked=[0])


def test_mesh_logits_equal_hugging_face_for_dense_and_full_rank_mapl():
    model = tiny_model()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    att = torch.ones(2, 12, dtype=torch.long)
    att[1, -3:] = 0  # right padding
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=att).logits
    for cfg in (config(model__name="tiny-llama", mesh__pp=4), mapl_cfg(boundary__rank=H, boundary__offset="static")):
        out = SimMesh(model, cfg).logits(ids, att)
        real = att.bool()
        assert torch.allclose(out[real], ref[real], atol=1e-4)


def _as_legacy(state: dict) -> dict:
    """A SimMesh state dict as written before the per-stage "anchor" was renamed "offset"."""
    def stage(sd):
        return {k.replace("boundary_modules.in_offset.", "boundary_modules.in_anchor."): v for k, v in sd.items()}

    def boundary(sd):
        return {("anchor." + k[len("offset."):] if k.startswith("offset.") else k): v for k, v in sd.items()}
    ranks = [[{**rk, "stage": stage(rk["stage"])} for rk in row] for row in state["ranks"]]
    return {**state, "ranks": ranks, "boundaries": [[boundary(sd) for sd in row] for row in state["boundaries"]]}


@pytest.mark.parametrize("offset", ["factorized", "full", "static"])
def test_stage_state_dict_with_the_old_in_anchor_key_loads(offset):
    trained = SimMesh(tiny_model(), mapl_cfg(boundary__offset=offset))
    with torch.no_grad():  # as if trained: every value differs from a fresh mesh's
        for t in [*trained.boundaries[0].parameters(), *trained.boundaries[0].buffers()]:
            t.add_(torch.randn_like(t))
    stage = trained.replicas[0][1]
    sd = stage.state_dict()
    old = {k.replace(".in_offset.", ".in_anchor."): v for k, v in sd.items()}
    assert any(".in_anchor." in k for k in old) and not any(".in_offset." in k for k in old)
    fresh = SimMesh(tiny_model(), mapl_cfg(boundary__offset=offset)).replicas[0][1]
    key = next(k for k in sd if ".in_offset." in k)
    assert not torch.equal(fresh.state_dict()[key], sd[key])
    fresh.load_state_dict(old)  # strict: no missing or unexpected keys
    assert fresh.state_dict().keys() == sd.keys()
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in sd.items())
    b = SimMesh(tiny_model(), mapl_cfg(boundary__offset=offset)).boundaries[0]
    b.load_state_dict({("anchor." + k[7:] if k.startswith("offset.") else k): v
                       for k, v in trained.boundaries[0].state_dict().items()})
    assert all(torch.equal(b.state_dict()[k], v) for k, v in trained.boundaries[0].state_dict().items())


def test_an_old_run_folder_loads(tmp_path, capsys):
    """config.toml with ``[boundary] anchor = ...`` and a checkpoint with ``in_anchor`` keys: load_mesh restores it."""
    from thinpipe.checkpoint import save_part, step_dir
    from thinpipe.engine.run_folder import load_mesh
    from thinpipe.models import load_model

    cfg = mapl_cfg(boundary__offset="full")
    mesh = SimMesh(load_model("tiny-llama").model, cfg)
    for seed in range(2):
        mesh.train_step([tiny_batch(batch_size=2, seed=seed)])
    # old key names inside today's checkpoint format (old pickled checkpoints are refused: test_reliability)
    save_part(step_dir(tmp_path / "checkpoint", mesh.step_index), "mesh", {"mesh": _as_legacy(mesh.state_dict())})
    toml = cfg.to_toml()
    assert toml.count('offset = "full"') == 1
    (tmp_path / "config.toml").write_text(toml.replace('offset = "full"', 'anchor = "full"'))
    capsys.readouterr()
    cfg2, restored, _ = load_mesh(tmp_path)
    assert capsys.readouterr().err.count("boundary.anchor is deprecated") == 1
    assert cfg2.to_dict() == cfg.to_dict() and restored.step_index == mesh.step_index
    for a, b in zip(mesh.replicas[0], restored.replicas[0]):
        assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    batch = tiny_batch(batch_size=2, seed=5)
    assert restored.eval_loss(batch) == mesh.eval_loss(batch)
    assert restored.train_step([batch]) == mesh.train_step([batch])  # optimizer state came back too
