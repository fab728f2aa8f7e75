"""``models/loading.py: save_weights``: a model's files written by the process that calls it, whatever its
torch.distributed rank (transformers' own save_pretrained skips them, silently, off rank 0)."""

import transformers.distributed.mixin as mixin

from thinpipe.models.loading import load_model, save_weights


def test_a_rank_other_than_0_writes_the_weights_that_plain_save_pretrained_skips(tmp_path, monkeypatch):
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 3)  # as on the rank train.model_rank names
    model = load_model("tiny-llama").model
    model.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "model.safetensors").exists()  # what the guard works around
    save_weights(model, tmp_path / "ours")
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "ours").iterdir()}
