"""DPO and GSPO through the run loop (anchor-priors App. D): in the simulation, with every boundary kind that
has no forward state; the exactness RL needs of a compressed mesh (the first update's log-ratio is exactly 0);
resume; the refusals. dist == sim for both objectives is in tests/integration/test_post_sft_dist.py."""

import json
import math
import random

import pytest
import torch

from tests.helpers import config, engine_step
from thinpipe.cli import main
from thinpipe.config import ConfigError
from thinpipe.engine.sim_engine import SimEngine
from thinpipe.objective.dpo import Dpo
from thinpipe.objective.gspo import Gspo


def prompts_file(folder, n=40, seed=0):
    r = random.Random(seed)
    path = folder / "prompts.jsonl"
    with open(path, "w") as f:
        for _ in range(n):
            a, b = r.randint(0, 4), r.randint(0, 4)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


def pairs_file(folder, n=40, seed=0):
    r = random.Random(seed)
    path = folder / "pairs.jsonl"
    with open(path, "w") as f:
        for _ in range(n):
            a, b = r.randint(0, 9), r.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}) + "\n")
    return path


def gspo_sets(path, **more):
    return {"model.name": "tiny-llama", "data.name": str(path), "train.objective": "gspo", "train.steps": 2,
            "train.seq_len": 48, "rl.max_response_tokens": 12, "mesh.pp": 2, "train.batch_size": 4,
            "train.lr": 1e-3, "data.val_fraction": 0.2, "data.val_rows": 4, "train.checkpoint_every": 0, **more}


def dpo_sets(path, **more):
    return {"model.name": "tiny-llama", "data.name": str(path), "train.objective": "dpo", "train.steps": 3,
            "train.seq_len": 32, "mesh.pp": 2, "train.batch_size": 4, "train.microbatches": 2, "train.lr": 1e-3,
            "data.val_fraction": 0.2, "data.val_rows": 4, "train.checkpoint_every": 0, **more}


def as_args(sets: dict) -> list[str]:
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def rows(folder):
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


STATELESS = {"identity": {}, "mask": {"boundary.kind": "mask", "boundary.p": 0.9},
             "quant4": {"boundary.kind": "quant4"}, "topk": {"boundary.kind": "topk", "boundary.p": 0.5},
             "outlier": {"boundary.kind": "outlier", "boundary.outlier_channels": 4, "boundary.quant_group": 16},
             "klt": {"boundary.kind": "klt", "boundary.quant_group": 16},
             "bottleneck": {"boundary.kind": "bottleneck", "boundary.p": 0.75},
             "mapl": {"boundary.kind": "mapl", "boundary.rank": 8}, "ssn": {"boundary.kind": "ssn", "boundary.rank": 8}}


@pytest.mark.parametrize("kind", list(STATELESS))
@pytest.mark.parametrize("layout", [{"train.batch_size": 4}, {"train.batch_size": 2, "rl.minibatches": 2},
                                    {"train.batch_size": 8, "rl.rollout_boundaries": "train"}])
def test_the_first_update_log_ratio_is_exactly_zero(tmp_path, kind, layout):
    """Old log-probs (a forward-only pass) and the first update's forward compute the same numbers: the PRF
    draws a sequence's masks from its (step, sequence) key, whatever microbatch it sits in."""
    cfg = config(**gspo_sets(prompts_file(tmp_path), **STATELESS[kind], **layout))
    engine = SimEngine(cfg)
    for step in range(2):
        engine_step(engine, step)
        assert engine.objective.first_update_log_ratio == 0.0
        m = engine.objective.metrics()
        assert m["response_len"] > 0 and math.isfinite(m["entropy"]) and 0 <= m["clip_fraction"] <= 1


@pytest.mark.parametrize("kind", [{"boundary.kind": "aqsgd"},
                                  {"boundary.kind": "mapl-vq", "boundary.rank": 8, "boundary.vq_codes": 16},
                                  {"boundary.kind": "klt", "boundary.quant_group": 16,
                                   "boundary.klt_refresh_every": 5}])
def test_a_kind_whose_forward_changes_its_state_is_refused_with_gspo(tmp_path, kind):
    with pytest.raises(ConfigError) as e:
        SimEngine(config(**gspo_sets(prompts_file(tmp_path), **kind)))
    assert "changes its state" in str(e.value) and "\n" not in str(e.value)


def test_gspo_rows_hold_the_rl_metrics_and_rollout_bytes(tmp_path):
    sets = gspo_sets(prompts_file(tmp_path), **{"eval.every": 1, "train.steps": 3, "rl.minibatches": 2,
                                                "boundary.kind": "mask", "boundary.p": 0.5})
    assert main(["train", "--out", str(tmp_path / "run"), "--quiet", *as_args(sets)]) == 0
    got = rows(tmp_path / "run")
    keys = {"reward_mean", "reward_std", "accuracy", "clip_fraction", "response_len", "entropy", "gen_tokens_per_s",
            "rollout_bytes", "pp_fwd_bytes", "loss", "grad_norm", "frac_reward_zero_std"}
    assert all(keys <= set(r) for r in got)
    # the share of groups whose rollouts all earned the same reward (TRL's name): every group when the step's do
    assert all(0 <= r["frac_reward_zero_std"] <= 1 for r in got)
    assert all(r["frac_reward_zero_std"] == 1 for r in got if r["reward_std"] == 0)
    assert "val_accuracy" in got[0] and "val_loss" not in got[0]
    # rollouts are metered beside training's bytes, and the held-out generation is not metered
    per_step = [b - a for a, b in zip([0] + [r["rollout_bytes"] for r in got], [r["rollout_bytes"] for r in got])]
    assert all(x > 0 for x in per_step)
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0 <= s["final_val_accuracy"] <= 1 and s["objective"] == "gspo" and "val_ppl" not in s


@pytest.mark.slow
def test_gspo_raises_a_reward_the_policy_can_learn(tmp_path, monkeypatch):
    """The loop's direction, end to end (rollouts -> rewards -> advantages -> the update that trains them): with a
    reward the policy can learn in a few steps (1 when a response's first token id is even, about half the
    vocabulary at the start), the rollout reward must rise. A misaligned advantage, a sign error or a lost update
    would leave it at ~0.5. (Issue 40: on the arithmetic task no setting has gained yet; this says the step itself
    climbs its reward.)"""
    import thinpipe.objective.gspo as gspo

    monkeypatch.setattr(gspo.Gspo, "_texts", lambda self, responses: [str(r[0] % 2) if r else "1" for r in responses])
    monkeypatch.setattr(gspo, "rewards_of", lambda texts, answers, lengths, rl: (
        torch.tensor([float(t == "0") for t in texts], dtype=torch.float64),) * 2)
    sets = gspo_sets(prompts_file(tmp_path), **{"train.steps": 30, "rl.group_size": 8, "rl.prompts_per_step": 4,
                                                "train.batch_size": 8, "train.lr": 1e-2, "eval.every": 0,
                                                "rl.max_response_tokens": 4})
    assert main(["train", "--out", str(tmp_path / "run"), "--quiet", *as_args(sets)]) == 0
    reward = [r["reward_mean"] for r in rows(tmp_path / "run")]
    assert sum(reward[-5:]) / 5 > 0.85 > 0.65 > sum(reward[:5]) / 5, reward


def test_dpo_starts_at_log_2_with_dense_boundaries_and_its_reference_is_the_start(tmp_path):
    """At the first step the policy is the reference: every implicit reward is 0, the loss is log 2."""
    sets = dpo_sets(pairs_file(tmp_path), **{"train.steps": 1})
    engine = SimEngine(config(**sets))
    engine.residual_start()
    ref = engine.objective.ref["train"]
    assert ref.shape == (len(engine.train_ds), 2) and (ref < 0).all()
    loss = engine_step(engine, 0)
    assert abs(loss - math.log(2)) < 1e-6
    assert engine.objective.metrics()["dpo_margin"] == pytest.approx(0.0, abs=1e-6)
    # held out, before any update: the same forward gives the reference, so every margin is exactly 0 (a tie is
    # not a win)
    fresh = SimEngine(config(**sets))
    fresh.residual_start()
    assert fresh.objective.validation() == pytest.approx(math.log(2), abs=1e-6)
    assert fresh.objective.validation_metrics() == {"val_dpo_accuracy": 0.0, "val_dpo_margin": 0.0}


def test_dpo_trains_and_writes_its_metrics(tmp_path):
    sets = dpo_sets(pairs_file(tmp_path), **{"train.steps": 8, "eval.every": 4, "train.lr": 3e-3})
    assert main(["train", "--out", str(tmp_path / "run"), "--quiet", *as_args(sets)]) == 0
    got = rows(tmp_path / "run")
    assert all({"dpo_margin", "dpo_accuracy"} <= set(r) for r in got) and "val_loss" in got[3]
    assert 0 <= got[3]["val_dpo_accuracy"] <= 1 and "val_dpo_margin" in got[3]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0 <= s["final_val_dpo_accuracy"] <= 1 and math.isfinite(s["final_val_dpo_margin"])
    assert got[-1]["loss"] < got[0]["loss"] and got[-1]["dpo_margin"] > 0


@pytest.mark.parametrize("objective", ["gspo", "dpo"])
def test_a_resumed_run_continues_the_same_trajectory(tmp_path, monkeypatch, objective):
    make, sets = (prompts_file, gspo_sets) if objective == "gspo" else (pairs_file, dpo_sets)
    cls = Gspo if objective == "gspo" else Dpo
    args = as_args(sets(make(tmp_path), **{"train.steps": 4, "train.checkpoint_every": 2, "boundary.kind": "mask",
                                          "boundary.p": 0.5, "mesh.dp": 2}))
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", "--out", str(full), "--quiet", *args]) == 0
    real = cls.step

    def crash(self, step):
        if step == 3:
            raise RuntimeError("simulated crash")
        return real(self, step)

    monkeypatch.setattr(cls, "step", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(["train", "--out", str(part), "--quiet", *args])
    monkeypatch.setattr(cls, "step", real)
    if objective == "dpo":  # the reference log-probs come from the checkpoint
        monkeypatch.setattr(Dpo, "start", lambda self: pytest.fail("recomputed on resume"))
    assert main(["train", "--out", str(part), "--quiet", "--resume", *args]) == 0
    a, b = rows(full), rows(part)
    drop = ("wall_s", "gen_tokens_per_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in a] == \
        [{k: v for k, v in r.items() if k not in drop} for r in b]


def test_lora_and_dp_compression_train_with_gspo(tmp_path):
    sets = gspo_sets(prompts_file(tmp_path), **{"train.lora.rank": 4, "mesh.dp": 2, "dp.kind": "powersgd",
                                                "dp.start_step": 0, "rl.minibatches": 2})
    assert main(["train", "--out", str(tmp_path / "run"), "--quiet", *as_args(sets)]) == 0
    got = rows(tmp_path / "run")
    assert got[-1]["dp_bytes"] > 0 and len(got) == 2


def test_objectives_refuse_what_they_cannot_train_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="user's files"):
        SimEngine(config(**gspo_sets("math")))


@pytest.mark.parametrize("objective", ["dpo", "gspo"])
def test_the_anchor_pass_of_an_objective_is_its_clean_gradient(tmp_path, objective):
    """With mesh.anchor = 1 the anchor circuit's pass runs the objective's own loss on replica 0's rows of the
    update at the weights that update's forward used: with dense fast boundaries its prior is the very gradient the
    fast replica computed (GSPO's first update is on-policy: the ratio is 1 in both)."""
    more = {"mesh.anchor": 1, "anchor.staleness": 1, "train.grad_clip": 0.0}
    cfg = config(**(gspo_sets(prompts_file(tmp_path), **more) if objective == "gspo" else
                    dpo_sets(pairs_file(tmp_path), **more)))
    engine = SimEngine(cfg)
    anchor, seen = engine.mesh.anchor, []
    run_cycle = anchor.run_cycle

    def spy(step, fast_stages, ctxs, replicas):  # replica 0's gradient as the cycle starts (before its optimizer step)
        seen.append([{n: p.grad.clone() for n, p in st.named_parameters() if p.grad is not None} for st in fast_stages])
        run_cycle(step, fast_stages, ctxs, replicas)

    anchor.run_cycle = spy
    engine.residual_start()
    engine_step(engine, 0)
    (prior,) = anchor.pending
    for fast, grads in zip(seen[0], prior.grads):
        assert fast.keys() == grads.keys() and fast
        for n in fast:
            torch.testing.assert_close(grads[n], fast[n], rtol=1e-5, atol=1e-7)
    engine_step(engine, 1)  # the prior of step 0 is consumed at step 1
    assert engine.mesh.priors_consumed == 1


@pytest.mark.parametrize("objective", ["dpo", "gspo"])
def test_objectives_train_with_the_anchor_circuit(tmp_path, objective):
    sets = {"mesh.anchor": 1, "anchor.staleness": 1, "boundary.kind": "mask", "boundary.p": 0.9, "train.steps": 3}
    sets = gspo_sets(prompts_file(tmp_path), **sets) if objective == "gspo" else dpo_sets(pairs_file(tmp_path), **sets)
    assert main(["train", "--out", str(tmp_path / "run"), "--quiet", *as_args(sets)]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["priors_consumed"] == 2 and summary["anchor_bytes"] > 0
    assert all(r["anchor_bytes"] > 0 for r in rows(tmp_path / "run"))


@pytest.mark.parametrize("keyed", [True, False])
def test_a_sequence_gets_its_old_log_probs_in_any_microbatch_layout(tmp_path, keyed):
    """The old-log-prob pass of 8 rollouts as one microbatch of 8 or four of 2: the same log-probs per sequence
    when masks are keyed by sequence; keyed by microbatch (SFT's key) they differ."""
    from thinpipe.objective.gspo import row_keys
    from thinpipe.objective.pipe import chunk_contexts, rollout_rows

    cfg = config(**gspo_sets(prompts_file(tmp_path), **{"boundary.kind": "mask", "boundary.p": 0.9}))
    engine = SimEngine(cfg)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (5 + i % 3,), generator=g).tolist() for i in range(8)]
    responses = [torch.randint(0, 256, (4 + i % 4,), generator=g).tolist() for i in range(8)]
    batch = rollout_rows(prompts, responses, 0)
    keys = row_keys(3, 0, 8) if keyed else None

    def old_logps(per):
        ctxs = chunk_contexts(batch, per, 3, 0, 1.0, keys)
        for c in ctxs:
            c.loss_fn = engine.objective._loss_fn("old")
        engine.objective.pipe.forward(0, ctxs, "train")
        return torch.cat([c.extras["old_logp"] for c in ctxs])

    one, four = old_logps(8), old_logps(2)
    if keyed:
        torch.testing.assert_close(one, four, rtol=0, atol=1e-6)
    else:
        assert (one - four).abs().max() > 1e-2


def test_gspo_from_an_sft_run_and_compare_reads_its_accuracy(tmp_path):
    """SFT -> GSPO (--init-from the SFT run's weights), then `thinpipe compare` of two GSPO runs: held-out
    accuracy, best = highest, "vs dense" as a difference in points."""
    from thinpipe.commands.compare import compare, format_table

    sft = tmp_path / "sft"
    assert main(["train", "--out", str(sft), "--quiet", "--set", "model.name=tiny-llama", "--set", "mesh.pp=2",
                 "--set", "data.name=synthetic", "--set", "train.steps=2", "--set", "train.seq_len=32"]) == 0
    path = prompts_file(tmp_path)
    for name, kind in (("dense", {}), ("mask", {"boundary.kind": "mask", "boundary.p": 0.5})):
        sets = {k: v for k, v in gspo_sets(path, **kind).items() if k != "model.name"}
        assert main(["train", "--out", str(tmp_path / name), "--quiet", "--init-from", str(sft),
                     *as_args(sets)]) == 0
    s = json.loads((tmp_path / "mask" / "summary.json").read_text())
    result = compare([tmp_path / "dense", tmp_path / "mask"])
    dense, mask = result["runs"]
    assert mask["measure"] == "val_accuracy" and mask["final_val_accuracy"] == s["final_val_accuracy"]
    assert mask["vs_dense_final"] == pytest.approx(s["final_val_accuracy"] - dense["final_val_accuracy"])
    assert "acc" in format_table(result)


def test_gspo_with_a_kl_to_the_start_keeps_its_reference_frozen(tmp_path):
    """rl.kl_beta > 0: the starting weights' log-probs of every rollout come from a frozen copy (dense
    boundaries) that stays the start while the policy moves; a model-part boundary is refused in one line."""
    cfg = config(**gspo_sets(prompts_file(tmp_path), **{"rl.kl_beta": 0.5, "boundary.kind": "mask",
                                                        "boundary.p": 0.5, "rl.minibatches": 2}))
    engine = SimEngine(cfg)
    ref = engine.objective.pipe.ref_workers[0][0].stage
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    for step in range(2):
        engine_step(engine, step)
    assert all(torch.equal(start[k], v) for k, v in ref.state_dict().items())
    moved = engine.mesh.ranks[0][0].stage.state_dict()
    assert any(not torch.equal(start[k], moved[k]) for k in start)
    with pytest.raises(ConfigError, match="kl_beta"):
        config(**gspo_sets(prompts_file(tmp_path), **{"rl.kl_beta": 0.5, "boundary.kind": "mapl"}))


@pytest.mark.parametrize("objective", ["gspo", "dpo"])
def test_a_data_driven_boundary_start_runs_on_the_objectives_data(tmp_path, objective):
    """The outlier boundary calibrates its channels before the first step (on prompts or pairs), as under SFT."""
    make, sets = (prompts_file, gspo_sets) if objective == "gspo" else (pairs_file, dpo_sets)
    engine = SimEngine(config(**sets(make(tmp_path), **{"boundary.kind": "outlier", "boundary.outlier_channels": 4,
                                                        "boundary.quant_group": 16})))
    b = engine.mesh.boundaries[0]
    before = b.channels.clone()
    engine.residual_start()
    assert not torch.equal(before, b.channels)


def test_rollouts_stop_at_the_chat_formats_end_of_turn_too(tmp_path):
    """A tokenizer whose EOS is not the end of an assistant turn (a base model under ChatML)."""
    from tests.chat_families import tokenizer
    from thinpipe.objective.gspo import stop_ids

    t = tokenizer("qwen2")
    t.eos_token = "<|endoftext|>"
    assert t.convert_ids_to_tokens(stop_ids(t, "chatml")) == ["<|endoftext|>", "<|im_end|>"]


def test_lora_dropout_is_refused_with_the_objectives(tmp_path):
    for sets in (gspo_sets(prompts_file(tmp_path)), dpo_sets(pairs_file(tmp_path))):
        with pytest.raises(ConfigError, match="train.lora.dropout"):
            config(**sets, **{"train.lora.rank": 4, "train.lora.dropout": 0.1})


def test_anchor_rows_round_trip_and_a_peers_bad_rows_are_refused():
    """What a pull carries for DPO's / GSPO's anchor pass (objective/pipe.py): the contexts come back with their
    tensors and loss scale exactly; rows that are not what pack_rows writes are refused before any use."""
    from thinpipe.comm.header import PayloadError
    from thinpipe.objective.pipe import check_rows, chunk_contexts, pack_rows, rollout_rows, unpack_rows

    batch = rollout_rows([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], 0)
    ctxs = chunk_contexts(batch, 1, 3, 0, 1.0 / 3)
    rows = pack_rows(ctxs, {"advantages": torch.tensor([0.5, -0.5])})
    check_rows(rows, ("advantages",), 2, 8, 32)
    back = unpack_rows(rows, 3, 1, "cpu", None)
    assert [c.loss_scale for c in back] == [1.0 / 3] * 2 and back[1].extras["advantages"].tolist() == [-0.5]
    assert all(torch.equal(a.input_ids, b.input_ids) and a.attn_mask == b.attn_mask
               for a, b in zip(ctxs, back))
    for bad in ({**rows, "input_ids": rows["input_ids"] + 40},           # token ids past the vocabulary
                {**rows, "extra": torch.zeros(2)},                        # a tensor it never sends
                {**rows, "advantages": torch.zeros(3)},                   # per-row tensors of other rows
                {**rows, "layout": torch.tensor([3, 0])}):                # microbatches that do not divide the rows
        with pytest.raises(PayloadError):
            check_rows(bad, ("advantages",), 2, 8, 32)
