"""Batched generation over pipeline stages with a KV cache per stage (rank/generation.py, engine/sim_generate.py).

References are independent of the code under test: Hugging Face ``generate`` on the merged model, the
old whole-sequence greedy loop over ``SimMesh.logits`` (no cache, one prompt at a time), Hugging Face's
logits warpers, and the boundaries' own byte formulas."""

import json

import pytest
import torch

from tests.helpers import config, tiny_model
from thinpipe.boundary.base import Boundary
from thinpipe.cli import main
from thinpipe.comm.header import PayloadError
from thinpipe.comm.inprocess import Mailbox
from thinpipe.comm.meter import ByteMeter
from thinpipe.comm.payload import Payload
from thinpipe.comm.tags import SampledTokens
from thinpipe.config import ConfigError
from thinpipe.data.byte_tokenizer import ByteTokenizer
from thinpipe.engine.sim_generate import generate_on_mesh, generate_on_stages
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.eval.generative import logits_generate
from thinpipe.models import build_stages
from thinpipe.rank.generation import (
    Sampling,
    check_token_message,
    finish_reason,
    token_expect,
    top_k_filter,
    top_p_filter,
    truncate_completion,
)

TOK = ByteTokenizer()
TEXTS = ["Question: what is 2 + 2?\nAnswer:", "Hi", "The quick brown fox"]  # three lengths: left padding
PROMPTS = [TOK.encode(t) for t in TEXTS]
GREEDY = Sampling(max_new_tokens=12, temperature=0)


def hf_generate(model, prompts, n, pad, eos=None):
    """Hugging Face greedy generation of a left-padded batch; each row cut after its first EOS."""
    t = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t), pad)
    att = torch.zeros(len(prompts), t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):], att[i, t - len(p):] = torch.tensor(p), 1
    out = model.generate(input_ids=ids, attention_mask=att, do_sample=False, max_new_tokens=n, pad_token_id=pad,
                         eos_token_id=eos)[:, t:].tolist()
    return [row[:row.index(eos) + 1] if eos in row else row for row in out]


def whole_sequence_greedy(mesh, prompt, n, eos=None):
    """The old path: the whole sequence through ``SimMesh.logits`` per token, no cache, one prompt."""
    new = []
    for _ in range(n):
        x = torch.tensor([prompt + new])
        new.append(int(mesh.logits(x, torch.ones_like(x))[0, -1].argmax()))
        if new[-1] == eos:
            break
    return new


@pytest.mark.parametrize("family, pp", [("llama", 2), ("qwen2", 3), ("llama", 1)])
def test_greedy_equals_hugging_face_generate_with_left_padding(family, pp):
    model = tiny_model(family).eval()
    mesh = SimMesh(model, config(model__name=f"tiny-{family}", mesh__pp=pp))
    got = generate_on_mesh(mesh, PROMPTS, GREEDY, TOK)
    assert got == hf_generate(model, PROMPTS, 12, TOK.pad_token_id)
    assert [len(g) for g in got] == [12, 12, 12]
    assert generate_on_mesh(mesh, PROMPTS, GREEDY, TOK, batch_size=2) == got  # split batches: the same ids


def test_any_replica_generates_over_its_own_row():
    model = tiny_model().eval()
    mesh = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2, mesh__dp=2))
    assert generate_on_mesh(mesh, PROMPTS, GREEDY, TOK, replica=1) == hf_generate(model, PROMPTS, 12, TOK.pad_token_id)


@pytest.mark.parametrize("kind", ["mapl", "ssn"])
def test_architectural_boundaries_generate_through_the_boundary_like_the_whole_sequence_path(kind):
    model = tiny_model().eval()
    mesh = SimMesh(model, config(model__name="tiny-llama", mesh__pp=3, boundary__kind=kind, boundary__rank=8))
    got = generate_on_mesh(mesh, PROMPTS, GREEDY, TOK)
    assert got == [whole_sequence_greedy(mesh, p, 12) for p in PROMPTS]
    # and as text, the old eval generator over the same logits
    old = logits_generate(mesh.logits)
    assert [truncate_completion(g, TOK, GREEDY) for g in got] == [old(None, TOK, t, [], 12) for t in TEXTS]
    if kind == "mapl":  # a rank-8 projector loses information: the boundary is really on the path
        assert got != hf_generate(model, PROMPTS, 12, TOK.pad_token_id)


class Recording(Boundary):
    """Dense, but records what a learned boundary would read from its context."""

    architectural = True

    def __init__(self, index, hidden):
        super().__init__(index, hidden)
        self.seen = []

    def encode(self, x, ctx):
        assert ctx.input_ids.shape == x.shape[:2] and ctx.position_ids.shape == x.shape[:2]
        keys = None if ctx.row_keys is None else ctx.row_keys.tolist()
        self.seen.append((tuple(x.shape), keys, ctx.step, ctx.input_ids[:, -1].tolist()))
        return super().encode(x, ctx)


def test_a_decode_step_sends_one_token_per_live_row_with_its_context():
    model = tiny_model().eval()
    stages = build_stages(model, None, 2)
    b = Recording(0, 64)
    first = generate_on_stages(stages, [b], Mailbox(ByteMeter()), PROMPTS, GREEDY, TOK)
    eos = first[1][3]   # row 1 stops where it first samples this (EOS kept), the others where they meet it
    cut = [g[:g.index(eos) + 1] if eos in g else g for g in first]
    b.seen.clear()
    keys = torch.tensor([11, 22, 33])
    s = Sampling(max_new_tokens=12, temperature=0, eos_ids=[eos])
    got = generate_on_stages(stages, [b], Mailbox(ByteMeter()), PROMPTS, s, TOK, row_keys=keys, step=7)
    assert got == cut and got[1][-1] == eos and len(got[1]) <= 4
    t = max(len(p) for p in PROMPTS)
    assert b.seen[0][:3] == ((3, t, 64), [11, 22, 33], 7)
    for r, (shape, rk, step, ids) in enumerate(b.seen[1:], 1):
        live = [i for i in range(3) if len(got[i]) > r]
        assert shape == (len(live), 1, 64) and rk == [int(keys[i]) for i in live] and step == 7
        assert ids == [got[i][r - 1] for i in live]  # the tokens sampled last round, of the live rows
    assert truncate_completion(got[1], TOK, s) == TOK.decode(got[1][:-1]) and finish_reason(got[1], TOK, s) == "eos"


def test_stop_strings_end_a_row_and_cut_its_text_as_the_old_path_does():
    model = tiny_model().eval()
    mesh = SimMesh(model, config(model__name="tiny-llama", mesh__pp=2))
    full = generate_on_mesh(mesh, PROMPTS, GREEDY, TOK)
    stop = TOK.decode(full[0][4:6])
    s = Sampling(max_new_tokens=12, temperature=0, stop=[stop])
    got = generate_on_mesh(mesh, PROMPTS, s, TOK)
    assert len(got[0]) <= 6 and stop in TOK.decode(got[0]) and finish_reason(got[0], TOK, s) == "stop"
    old = logits_generate(mesh.logits)
    assert [truncate_completion(g, TOK, s) for g in got] == [old(None, TOK, t, [stop], 12) for t in TEXTS]


@pytest.mark.parametrize("kind, pp", [("identity", 2), ("mapl", 3)])
def test_bytes_metered_equal_the_formula(kind, pp):
    mesh = SimMesh(tiny_model().eval(), config(model__name="tiny-llama", mesh__pp=pp, boundary__kind=kind,
                                               boundary__rank=8, boundary__dtype="float32"))
    free = generate_on_mesh(mesh, PROMPTS, GREEDY, TOK)
    eos = free[0][5]
    got = generate_on_mesh(mesh, PROMPTS, Sampling(max_new_tokens=12, temperature=0, eos_ids=[eos]), TOK,
                           axis="rollout")
    assert min(len(g) for g in got) < 12  # rows left early: fewer tokens cross
    t = max(len(p) for p in PROMPTS)
    live = [sum(len(g) > r for g in got) for r in range(max(len(g) for g in got))]
    want = 0
    for b in mesh.boundaries:  # prefill: every prompt position; then one token per live row and round
        want += b.expected_bytes(3 * t, 4)[0] + sum(b.expected_bytes(n, 4)[0] for n in live[1:])
    want += sum(live) * 2 * 8 * (pp - 1)  # the token message: tokens + done flags, int64, to every other stage
    assert mesh.meter.totals["rollout"] == want
    assert mesh.meter.totals["pp_fwd"] == 0


def test_sampling_is_repeatable_per_seed_and_top_k_1_is_greedy():
    mesh = SimMesh(tiny_model().eval(), config(model__name="tiny-llama", mesh__pp=2))

    def sample(**kw):
        return generate_on_mesh(mesh, PROMPTS, Sampling(max_new_tokens=12, **kw), TOK)

    a, b, c = sample(seed=1), sample(seed=1), sample(seed=2)
    assert a == b and a != c
    # each sequence draws from its own stream: the same ids however the prompts are cut into batches, and two
    # copies of one prompt sample independently
    assert generate_on_mesh(mesh, PROMPTS, Sampling(max_new_tokens=12, seed=1), TOK, batch_size=1) == a
    twice = generate_on_mesh(mesh, [PROMPTS[0]] * 2, Sampling(max_new_tokens=12, seed=1), TOK, batch_size=1)
    assert twice[0] == a[0] and twice[1] != twice[0]
    assert sample(seed=3, top_k=1) == generate_on_mesh(mesh, PROMPTS, GREEDY, TOK)
    assert sample(seed=3, temperature=0.7, top_p=0.9, top_k=20) == sample(seed=3, temperature=0.7, top_p=0.9, top_k=20)


@pytest.mark.parametrize("k, p", [(0, 0.9), (5, 1.0), (5, 0.7), (1, 1.0), (0, 0.3), (80, 0.95), (3, 0.999)])
def test_top_k_then_top_p_equal_hugging_face_warpers(k, p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(k * 100 + int(p * 1000))
    logits = torch.randn(6, 64, generator=g) * 3
    logits[0, :4] = logits[0].max()  # ties at the top
    want = logits.clone()
    if k:
        want = TopKLogitsWarper(k)(None, want)
    if p < 1:
        want = TopPLogitsWarper(p)(None, want)
    got = top_p_filter(top_k_filter(logits, k), p)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got[~got.isinf()], want[~want.isinf()])
    assert bool((~got.isinf()).any(dim=-1).all())


def test_the_token_message_is_checked_before_use():
    box = Mailbox(ByteMeter())
    three = Payload({"tokens": torch.tensor([1, 2, 3]), "done": torch.tensor([0, 0, 1])})
    box.send(SampledTokens(0, 0, ("gen", 0, 0)), three, None)
    with pytest.raises(PayloadError, match="refused before allocating"):
        box.recv(SampledTokens(0, 0, ("gen", 0, 0)), token_expect(2))
    with pytest.raises(PayloadError, match="ids outside"):
        check_token_message(Payload({"tokens": torch.tensor([5, 600]), "done": torch.tensor([0, 0])}), 512)
    with pytest.raises(PayloadError, match="done flags"):
        check_token_message(Payload({"tokens": torch.tensor([5, 6]), "done": torch.tensor([0, 2])}), 512)
    tok, done = check_token_message(three, 512)
    assert tok.tolist() == [1, 2, 3] and done.tolist() == [False, False, True]


@pytest.mark.parametrize("field, value, match", [
    ("max_new_tokens", 0, "max_new_tokens must be an integer >= 1"), ("temperature", -0.5, "temperature must be"),
    ("temperature", float("nan"), "temperature must be"), ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, "top_p must be"), ("top_k", -1, "top_k must be"), ("seed", -3, "seed must be"),
    ("stop", [""], "stop strings must be non-empty"), ("eos_ids", [-1], "eos_ids must be token ids"),
])
def test_sampling_settings_are_checked_in_one_line(field, value, match):
    with pytest.raises(ConfigError, match=match) as e:
        Sampling(**{field: value}).validate()
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="prompt 1 of the batch is empty"):
        generate_on_stages(build_stages(tiny_model(), None, 1), [], Mailbox(ByteMeter()), [[1], []], GREEDY, TOK)


def test_generate_command_prints_completions_and_json_records(tmp_path, capsys):
    from thinpipe.models import load_model

    args = ["generate", "--model", "tiny-llama", "--max-new-tokens", "6", "--temperature", "0", "--set", "mesh.pp=2"]
    assert main([*args, "--prompt", TEXTS[0], "--prompt", TEXTS[1], "--json"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["prompt"] for r in rows] == TEXTS[:2] and "generating 2 completion" in captured.err
    ref = load_model("tiny-llama", seed=0).model.eval()  # what the command loads (train.seed = 0)
    assert [r["tokens"] for r in rows] == hf_generate(ref, PROMPTS[:2], 6, TOK.pad_token_id, TOK.eos_token_id)
    assert all(r["completion"] == truncate_completion(r["tokens"], TOK, Sampling(eos_ids=[TOK.eos_token_id]))
               and r["finish_reason"] in ("eos", "length") for r in rows)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))  # one holds "\n"
    assert main([*args, "--prompts", str(tmp_path / "p.jsonl"), "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == TEXTS
    (tmp_path / "p.txt").write_text(f"{TEXTS[1]}\n\n{TEXTS[2]}\n")  # one prompt per line, blank lines skipped
    assert main([*args, "--prompts", str(tmp_path / "p.txt")]) == 0
    assert capsys.readouterr().out == "".join(r["completion"] + "\n" for r in rows[1:])
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    for bad, line in [([], "no prompt"), (["--prompts", str(tmp_path / "nope.txt")], "no such file"),
                      (["--prompts", str(tmp_path / "bad.jsonl")], "line 1"),
                      (["--prompt", "x", "--top-p", "0"], "top_p must be"),
                      (["--prompt", "x", "--run", str(tmp_path)], "not both")]:
        assert main([*args, *bad]) == 2
        err = capsys.readouterr().err
        assert line in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_eval_generates_on_the_mesh_as_the_old_paths_did(tmp_path, capsys):
    """gsm8k on tiny runs: the batched mesh generation gives the old one-by-one paths' completions
    (the merged model with Hugging Face's cache for a dense run, the whole-sequence mesh logits for MAPL)."""
    from tests.unit.eval.test_generative import items
    from thinpipe.commands.evaluate import mesh_generator
    from thinpipe.engine.run_folder import load_mesh, load_run
    from thinpipe.eval.generative import evaluate_generative

    items("gsm8k", 1)  # skips (or fails under CI) without the benchmark wheel
    for kind in ("identity", "mapl"):
        run = tmp_path / kind
        sets = ["model.name=tiny-llama", "data.name=synthetic", "train.steps=2", "train.batch_size=2",
                "train.seq_len=32", "data.val_rows=2", "mesh.pp=2", f"boundary.kind={kind}", "boundary.rank=8"]
        assert main(["train", "--out", str(run), "--quiet", *[x for s in sets for x in ("--set", s)]]) == 0
        capsys.readouterr()
        _, mesh, loaded = load_mesh(run)
        kw = dict(limit=3, max_new_tokens=12, progress=False)
        new = evaluate_generative(None, TOK, "gsm8k", generate_batch=mesh_generator(TOK, mesh=mesh), batch_size=2,
                                  **kw)
        if kind == "identity":
            old = evaluate_generative(load_run(run)[1].eval(), TOK, "gsm8k", **kw)
        else:
            old = evaluate_generative(None, TOK, "gsm8k", generate=logits_generate(mesh.logits), **kw)
        assert new["samples"] == old["samples"] and len(new["samples"]) == 3
        gen = main(["generate", "--run", str(run), "--prompt", TEXTS[0], "--temperature", "0",
                    "--max-new-tokens", "12", "--json"])
        assert gen == 0
        tokens = json.loads(capsys.readouterr().out)["tokens"]
        s = Sampling(max_new_tokens=12, temperature=0, eos_ids=[TOK.eos_token_id])
        assert tokens == generate_on_mesh(mesh, PROMPTS[:1], s, TOK)[0]


@pytest.mark.slow
def test_smollm2_greedy_equals_hugging_face_generate():
    from thinpipe.models import load_model

    loaded = load_model("smollm2-135m")
    model, tok = loaded.model.eval(), loaded.tokenizer
    prompts = [tok.encode(t, add_special_tokens=False) for t in
               ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number."]]
    mesh = SimMesh(model, config(model__name="smollm2-135m", mesh__pp=2))
    eos = tok.eos_token_id
    got = generate_on_mesh(mesh, prompts, Sampling(max_new_tokens=16, temperature=0, eos_ids=[eos]), tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    assert got == hf_generate(model, prompts, 16, pad, eos)
    assert all(len(g) > 4 for g in got)
