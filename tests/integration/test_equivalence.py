"""Identity boundaries == the unsplit model, bitwise (DESIGN.md property 1)."""

import pytest
import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.engine.sim_mesh import SimMesh


def _grads(mesh, replica=0):
    out = {}
    for st in mesh.replicas[replica]:
        for name, p in st.named_parameters():
            key = name if name.startswith("lm_head") else f"model.{name}"
            if key == "lm_head.weight" and st.tied_embeddings:
                key = "model.embed_tokens.weight"  # the last stage's copy of the tied matrix
            if p.grad is not None:
                out.setdefault(key, []).append(p.grad.clone())
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("microbatches", [1, 3])
def test_identity_boundaries_equal_unsplit(family, pp, microbatches):
    model = tiny_model(family)
    batch = tiny_batch(batch_size=3)
    ref = SimMesh(model, config(model__name=f"tiny-{family}", train__batch_size=3, train__microbatches=microbatches))
    split = SimMesh(model, config(model__name=f"tiny-{family}", mesh__pp=pp, train__batch_size=3,
                                  train__microbatches=microbatches))
    loss_ref = ref.forward_backward([batch])
    loss_split = split.forward_backward([batch])
    assert loss_ref == loss_split  # bitwise (Python floats from identical fp32 sums)
    g_ref, g_split = _grads(ref), _grads(split)
    assert g_ref.keys() == g_split.keys()
    for name, (gr,) in g_ref.items():
        gs = g_split[name]
        if len(gs) == 2:  # tied embedding held by the first and last stage: the engine sums the two
            total = gs[0] + gs[1]
            if microbatches == 1:
                assert torch.equal(gr, total), name
            else:
                # The unsplit model accumulates (head + embed) per microbatch, the split one sums
                # each end over microbatches first: same terms, different float summation order.
                torch.testing.assert_close(gr, total, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(gr, gs[0]), name


def test_unsplit_matches_huggingface_forward():
    """The stage code at pp=1 computes the same loss as the Hugging Face model's own forward."""
    model = tiny_model("llama")
    batch = tiny_batch(batch_size=2)
    batch["segment_ids"].zero_()  # one document per row: HF's plain causal mask applies
    labels = batch["labels"]
    mesh = SimMesh(model, config(model__name="tiny-llama", train__batch_size=2))
    loss_sum, n = mesh.eval_loss(batch)
    with torch.no_grad():
        hf = model(input_ids=batch["input_ids"], labels=labels).loss
    torch.testing.assert_close(torch.tensor(loss_sum / n), hf, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_training_trajectory_split_equals_unsplit(schedule):
    """Several optimizer steps (AdamW, clip, cosine): pp=4 with identity boundaries stays bitwise equal
    to pp=1 for an untied model."""
    model = tiny_model("llama")
    kw = dict(model__name="tiny-llama", train__batch_size=4, train__microbatches=2, train__steps=3,
              train__lr=1e-3, train__schedule=schedule, train__grad_clip=0.2)
    a, b = SimMesh(model, config(**kw)), SimMesh(model, config(mesh__pp=4, **kw))
    for step in range(3):
        batch = tiny_batch(batch_size=4, seed=step)
        assert a.train_step([batch]) == b.train_step([batch])
    sa = {k: v for st in a.replicas[0] for k, v in st.hf_state_dict().items()}
    sb = {k: v for st in b.replicas[0] for k, v in st.hf_state_dict().items()}
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_explicit_uneven_split_equals_unsplit():
    model = tiny_model("llama")
    batch = tiny_batch(batch_size=2)
    ref = SimMesh(model, config(model__name="tiny-llama", train__batch_size=2))
    split = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2, mesh__split=[1, 3], train__batch_size=2))
    assert [len(st.layers) for st in split.replicas[0]] == [1, 3]
    assert ref.forward_backward([batch]) == split.forward_backward([batch])
