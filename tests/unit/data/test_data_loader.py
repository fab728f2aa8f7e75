"""batches(): deterministic, DP shards disjoint within an epoch, start_step resume == skipping."""

import itertools

import pytest
import torch

from thinpipe.data import ByteTokenizer, PackedDataset, batches, build_dataset, steps_per_epoch


def _toy(n_rows=23, T=4):
    ids = torch.arange(n_rows).repeat_interleave(T).view(n_rows, T)  # row r is all r
    return PackedDataset(ids, ids.clone(), torch.zeros_like(ids))


def _rows(batch):
    return batch["input_ids"][:, 0].tolist()


def test_batches_are_deterministic_and_well_shaped():
    ds = _toy()
    a = [_rows(b) for b in itertools.islice(batches(ds, 3, seed=1), 20)]
    b = [_rows(b) for b in itertools.islice(batches(ds, 3, seed=1), 20)]
    c = [_rows(b) for b in itertools.islice(batches(ds, 3, seed=2), 20)]
    assert a == b and a != c
    batch = next(batches(ds, 3, seed=1))
    assert set(batch) == {"input_ids", "labels", "segment_ids"}
    assert all(v.shape == (3, 4) and v.dtype == torch.long for v in batch.values())


@pytest.mark.parametrize("num_shards,batch_size", [(1, 4), (2, 3), (4, 2), (3, 1)])
def test_shards_are_disjoint_within_each_epoch(num_shards, batch_size):
    ds = _toy()
    spe = steps_per_epoch(len(ds), batch_size, num_shards)
    assert spe > 0
    for epoch in range(3):
        taken = []
        for k in range(num_shards):
            it = batches(ds, batch_size, seed=0, shard=k, num_shards=num_shards, start_step=epoch * spe)
            for batch in itertools.islice(it, spe):
                taken += _rows(batch)
        assert len(taken) == len(set(taken)) == num_shards * spe * batch_size
    # epochs are reshuffled
    first = [_rows(b) for b in itertools.islice(batches(ds, batch_size, 0, 0, num_shards), spe)]
    second = [_rows(b) for b in itertools.islice(batches(ds, batch_size, 0, 0, num_shards, spe), spe)]
    assert first != second


@pytest.mark.parametrize("start_step", [0, 1, 4, 7, 13, 50])
def test_start_step_resume_equals_skipping(start_step):
    ds = _toy()
    full = [_rows(b) for b in itertools.islice(batches(ds, 4, seed=5, shard=1, num_shards=2), start_step + 10)]
    resumed = [_rows(b) for b in itertools.islice(batches(ds, 4, seed=5, shard=1, num_shards=2,
                                                          start_step=start_step), 10)]
    assert resumed == full[start_step:]


def test_bad_arguments_fail_eagerly():
    ds = _toy()
    for kwargs in ({"shard": 2, "num_shards": 2}, {"num_shards": 0}, {"start_step": -1}):
        with pytest.raises(ValueError):
            batches(ds, 2, seed=0, **kwargs)
    with pytest.raises(ValueError, match="too few"):
        batches(ds, 12, seed=0, num_shards=2)


def test_build_dataset_synthetic_is_deterministic_and_capped():
    tok = ByteTokenizer()
    a = build_dataset("synthetic", tok, 64, "train", seed=0, max_examples=500)
    b = build_dataset("synthetic", tok, 64, "train", seed=0, max_examples=500)
    c = build_dataset("synthetic", tok, 64, "train", seed=1, max_examples=500)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.input_ids[: len(c)], c.input_ids[: len(a)])
    assert a.stats["num_examples"] == 500 and a.stats["num_packed"] == 500
    assert a.input_ids.shape[1] == 64 and len(a) == a.stats["num_rows"]
    assert int((a.segment_ids == 0).any(dim=1).sum()) == len(a)  # no empty row


def test_held_out_rows_do_not_follow_the_seed():
    """Issue 26: runs of different train.seed are scored on the same held-out rows, in the same order
    (data.val_rows takes a prefix), so their losses pair; the training rows still follow the seed."""
    tok = ByteTokenizer()
    v0, v1 = (build_dataset("synthetic", tok, 64, "val", seed=s) for s in (0, 1))
    assert torch.equal(v0.input_ids, v1.input_ids) and torch.equal(v0.labels, v1.labels)
    t0, t1 = (build_dataset("synthetic", tok, 64, "train", seed=s, max_examples=200) for s in (0, 1))
    assert not torch.equal(t0.input_ids[: len(t1)], t1.input_ids[: len(t0)])
