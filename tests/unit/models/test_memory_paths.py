"""What a stage does to fit long sequences (issue 51), each equal to the plain path: the chunked head and loss
(``train.loss_chunk_tokens``) and activation checkpointing (``train.activation_checkpointing``) with random
boundaries, LoRA, the anchor circuit, DiLoCo and every objective. (Packed attention: test_families.py.)"""

import pytest
import torch

from tests.helpers import assert_same_model_folder, config
from tests.integration.test_post_sft_train import as_args, dpo_sets, gspo_sets, pairs_file, prompts_file, rows
from thinpipe.cli import main
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.models import stages as stages_module
from thinpipe.models.loading import load_model
from thinpipe.models.stages import chunked_next_token_loss, next_token_loss


@pytest.mark.parametrize("chunk", [1, 5, 7, 26, 64])
def test_the_chunked_loss_equals_the_whole_one_with_its_gradients(chunk):
    torch.manual_seed(0)
    h = torch.randn(2, 13, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    labels = torch.randint(0, 50, (2, 13))
    labels[0, :3] = -100
    labels[1, 9:] = -100
    want = next_token_loss(head(h).float(), labels)
    gh, gw = torch.autograd.grad(want, (h, head.weight))
    got = chunked_next_token_loss(h, labels, head, chunk)
    ch, cw = torch.autograd.grad(got, (h, head.weight))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ch, gh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cw, gw, rtol=1e-6, atol=1e-6)


def test_a_stage_chunks_its_loss_past_the_threshold_only():
    model = load_model("tiny-llama").model
    batch = {"input_ids": torch.randint(0, 256, (2, 16)), "labels": torch.randint(0, 256, (2, 16)),
             "segment_ids": torch.zeros(2, 16, dtype=torch.int64)}
    out = {}
    for chunk in (0, 8):  # 32 tokens: whole; over 8: chunks of 4 tokens per row
        mesh = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2, train__batch_size=2,
                                     train__loss_chunk_tokens=chunk))
        assert mesh.replicas[0][-1].loss_chunk_tokens == chunk
        out[chunk] = mesh.forward_backward([batch]), {n: p.grad.clone() for n, p in
                                                      mesh.replicas[0][-1].named_parameters() if p.grad is not None}
    assert out[0][0] == pytest.approx(out[8][0], rel=1e-6)
    for name, g in out[0][1].items():
        torch.testing.assert_close(out[8][1][name], g, rtol=1e-5, atol=1e-6)


SFT = {"model.name": "tiny-llama", "data.name": "synthetic", "train.steps": 4, "train.batch_size": 2,
       "train.seq_len": 32, "train.microbatches": 2, "train.lr": 1e-3, "train.checkpoint_every": 0, "mesh.pp": 2,
       "mesh.dp": 2, "mesh.anchor": 1, "boundary.kind": "mask", "train.lora.rank": 4, "dp.kind": "diloco",
       "dp.inner_steps": 2, "anchor.staleness": 1}
CASES = {"sft: mask, LoRA, anchor circuit, DiLoCo": lambda tmp: SFT,
         "dpo: mask": lambda tmp: dpo_sets(pairs_file(tmp), **{"boundary.kind": "mask", "boundary.p": 0.5}),
         "gspo: mask": lambda tmp: gspo_sets(prompts_file(tmp), **{"boundary.kind": "mask", "boundary.p": 0.5})}


@pytest.mark.slow  # ~10 s each: two runs
@pytest.mark.parametrize("case", list(CASES))
def test_activation_checkpointing_changes_no_number(case, tmp_path, monkeypatch):
    """Every row (loss, gradient norm, bytes, held-out measure) and the final weights bitwise equal; and the layers
    did run under checkpointing."""
    sets = CASES[case](tmp_path)
    calls = []
    real = stages_module.checkpoint

    def counted(fn, *args, **kwargs):
        calls.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(stages_module, "checkpoint", counted)
    for on in (False, True):
        assert main(["train", "--out", str(tmp_path / str(on)), "--quiet", *as_args(sets),
                     "--set", f"train.activation_checkpointing={str(on).lower()}"]) == 0
        if not on:
            assert not calls
    assert any(isinstance(fn, torch.nn.Module) for fn in calls)  # decoder layers (the loss's chunks are functions)
    drop = ("wall_s", "gen_tokens_per_s")
    a, b = ([{k: v for k, v in r.items() if k not in drop} for r in rows(tmp_path / x)] for x in ("False", "True"))
    assert a == b
    assert_same_model_folder(tmp_path / "True" / "model", tmp_path / "False" / "model")
