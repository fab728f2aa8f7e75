"""The data of the post-SFT objectives: DPO preference pairs and GSPO prompts from a user's files, checked
against SFT's own tokenization (chat.py) of the same exchanges, for the byte tokenizer, three chat-template
families built locally and (slow) SmolLM2's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.chat_families import FAMILIES, tokenizer
from thinpipe.config import ConfigError
from thinpipe.data import ByteTokenizer, resolve_chat_format, tokenize_chat, tokenize_messages
from thinpipe.data.packing import IGNORE_INDEX
from thinpipe.data.preferences import build_preference_dataset, pair_batches
from thinpipe.data.prompts import build_prompt_dataset, prompt_batches
from thinpipe.data.rows import DataError

U1 = {"role": "user", "content": "What is 2+2?"}
A1 = {"role": "assistant", "content": "It is 4."}
U2 = {"role": "user", "content": "And x + 3 = 5?"}
GOOD = {"role": "assistant", "content": "x = 2."}
BAD = {"role": "assistant", "content": "x = 8, I think."}
SYSTEM = {"role": "system", "content": "Be brief."}


def _jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _pairs(tmp_path, rows, tok=None, seq_len=128, **kw):
    kw.setdefault("val_fraction", 0.0)
    return build_preference_dataset(_jsonl(tmp_path / "p.jsonl", rows), tok or ByteTokenizer(), seq_len, "train", 0,
                                    **kw)


def _sft(tok, prompt, answer, fmt):
    """SFT's ids and labels of a conversation whose last assistant turn is the answer (chat.py)."""
    ids, mask = tokenize_messages(tok, prompt + answer, fmt)
    n_prompt = sum(tokenize_messages(tok, prompt, fmt)[1])  # loss tokens of assistant turns inside the prompt
    keep = [i for i, m in enumerate(mask) if m][n_prompt:]
    return ids, [ids[i] if i in keep else IGNORE_INDEX for i in range(len(ids))]


def _real(ds, row):
    return ds.input_ids[row][ds.segment_ids[row] == 0].tolist()


# ---------------------------------------------------------------- preference pairs: the tokens are SFT's
def test_text_pairs_are_sfts_chatml_exchange_with_labels_on_exactly_the_response(tmp_path):
    tok = ByteTokenizer()
    rows = [{"prompt": f"q{i}?", "chosen": f"good answer {i}", "rejected": f"no {i}", "score": 1} for i in range(3)]
    ds = _pairs(tmp_path, rows, tok, seq_len=64)
    assert len(ds) == 3 and ds.input_ids.shape == (6, 64) and ds.input_ids.dtype == torch.int64
    for i, r in enumerate(rows):
        for row, answer in ((2 * i, r["chosen"]), (2 * i + 1, r["rejected"])):
            ids, mask = tokenize_chat(tok, r["prompt"], answer)  # SFT's tokens for the pair (the paper's ChatML)
            n = len(ids)
            assert ds.input_ids[row, :n].tolist() == ids
            assert ds.labels[row, :n].tolist() == [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
            assert tok.decode(ds.labels[row][ds.labels[row] != IGNORE_INDEX]) == answer + "<|im_end|>\n"
            assert (ds.segment_ids[row, :n] == 0).all() and (ds.segment_ids[row, n:] == -1).all()
            assert (ds.input_ids[row, n:] == tok.pad_token_id).all() and (ds.labels[row, n:] == IGNORE_INDEX).all()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_conversational_pairs_match_sft_with_each_familys_template_and_a_multi_turn_prompt(tmp_path, family):
    tok = tokenizer(family)
    prompt = [U1, A1, U2] if family == "mistral" else [SYSTEM, U1, A1, U2]  # Mistral v0.1 refuses a system turn
    fmt = resolve_chat_format(tok, "template")
    ds = _pairs(tmp_path, [{"prompt": prompt, "chosen": [GOOD], "rejected": [BAD]}], tok, chat_format="template")
    end = FAMILIES[family][6]
    for row, answer in ((0, GOOD), (1, BAD)):
        ids, labels = _sft(tok, prompt, [answer], fmt)
        assert ids == list(tok.apply_chat_template(prompt + [answer], tokenize=True)["input_ids"])
        assert _real(ds, row) == ids and ds.labels[row, :len(ids)].tolist() == labels
        # the earlier assistant turn ("It is 4.") is prompt: only this answer and its end of turn are learned
        assert tok.decode(ds.labels[row][ds.labels[row] != IGNORE_INDEX]) == answer["content"] + end


@pytest.mark.parametrize("fmt", ["chatml", "none"])
def test_text_and_message_forms_and_the_implicit_prompt_give_the_same_rows(tmp_path, fmt):
    tok = tokenizer("llama3")  # adds a BOS: chatml and none start with it
    rows = [{"prompt": "What is 2+2?", "chosen": "It is 4.", "rejected": "Five."},
            {"prompt": [U1], "chosen": [A1], "rejected": [{"role": "assistant", "content": "Five."}]},
            {"chosen": [U1, A1], "rejected": [U1, {"role": "assistant", "content": "Five."}]}]
    ds = _pairs(tmp_path, rows, tok, chat_format=fmt)
    for k in (1, 2):
        for a in ("input_ids", "labels", "segment_ids"):
            assert torch.equal(ds.rows([k])[a], ds.rows([0])[a])
    ids, labels = _sft(tok, [U1], [A1], fmt)
    assert ds.input_ids[0, :len(ids)].tolist() == ids and ds.labels[0, :len(ids)].tolist() == labels
    if fmt == "none":  # the response's text and the tokenizer's EOS, nothing else
        assert tok.decode(ds.labels[0][ds.labels[0] != IGNORE_INDEX]) == "It is 4.<|eot_id|>"
    # the implicit prompt of multi-turn conversations differing in their last answer is the shared opening
    ds2 = _pairs(tmp_path, [{"chosen": [U1, A1, U2, GOOD], "rejected": [U1, A1, U2, BAD]},
                            {"prompt": [U1, A1, U2], "chosen": [GOOD], "rejected": [BAD]},
                            # a shared prefix ending in an assistant turn: the answers start with that turn
                            {"chosen": [U1, A1, U2, GOOD], "rejected": [U1, A1]},
                            {"prompt": [U1], "chosen": [A1, U2, GOOD], "rejected": [A1]}], tok, chat_format=fmt)
    assert torch.equal(ds2.rows([0])["labels"], ds2.rows([1])["labels"])
    assert torch.equal(ds2.rows([2])["labels"], ds2.rows([3])["labels"])
    assert tok.decode(ds2.labels[5][ds2.labels[5] != IGNORE_INDEX]).startswith(A1["content"])


def test_rows_take_pairs_in_order_chosen_first_with_pair_ids(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(5)]
    ds = _pairs(tmp_path, rows)
    tok = ByteTokenizer()
    for index in ([3, 1], torch.tensor([3, 1]), slice(1, 4, 2)):
        got = ds.rows(index)
        want = [3, 1] if not isinstance(index, slice) else [1, 3]
        assert got["pair_ids"].tolist() == [p for p in want for _ in (0, 1)] and got["input_ids"].shape[0] == 4
        for j, p in enumerate(want):
            chosen, rejected = (tok.decode(got["input_ids"][2 * j + k]) for k in (0, 1))
            assert f"c{p}<" in chosen and f"r{p}<" in rejected
    assert torch.equal(ds.rows(-1)["input_ids"], ds.input_ids[8:10]) and ds.rows(-1)["pair_ids"].tolist() == [4, 4]


def test_a_long_answer_is_cut_at_its_end_and_a_long_prompt_is_an_error_or_a_counted_skip(tmp_path, capsys):
    tok = ByteTokenizer()
    full, _ = tokenize_chat(tok, "q", "a" * 40)
    p_len = len(tokenize_chat(tok, "q", "")[0]) - 2  # the prompt part: all but "<|im_end|>\n"
    ds = _pairs(tmp_path, [{"prompt": "q", "chosen": "a" * 40, "rejected": "b"}], tok, seq_len=30)
    assert ds.input_ids[0].tolist() == full[:30]  # keep_start: the prompt and the answer's beginning
    assert int((ds.labels[0] != IGNORE_INDEX).sum()) == 30 - p_len and (ds.segment_ids[0] == 0).all()
    assert ds.stats["num_truncated"] == 1 and "1 of 1 train pairs" in capsys.readouterr().err
    rows = [{"prompt": "q" * 40, "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "a", "rejected": "b"}]
    with pytest.raises(DataError, match=r"p.jsonl:1: the prompt takes \d+ tokens of train.seq_len = 30") as e:
        _pairs(tmp_path, rows, tok, seq_len=30)
    assert "\n" not in str(e.value)
    ds = _pairs(tmp_path, rows, tok, seq_len=30, skip_bad_rows=True)
    assert len(ds) == 1 and ds.stats["skipped_rows"] == 1 and "skipped 1 bad train" in capsys.readouterr().err


@pytest.mark.parametrize("row,why", [
    ({"prompt": "q", "chosen": "a"}, r"needs \"prompt\", \"chosen\" and \"rejected\" \(it has: chosen, prompt\)"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, r"\"chosen\" must be a string or .* got a number"),
    ({"prompt": "q", "chosen": "a", "rejected": ""}, r"\"rejected\" is an empty string"),
    ({"prompt": [U1], "chosen": [A1], "rejected": []}, r"\"rejected\" must be .* got an empty list"),
    ({"prompt": [U1], "chosen": [A1], "rejected": [U2]}, r"\"rejected\" must end with a non-empty assistant"),
    ({"prompt": [U1, A1], "chosen": [GOOD], "rejected": [BAD]}, r"\"prompt\" ends with an assistant turn"),
    ({"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"}, r"prompt\[0\] must be an object with"),
    ({"chosen": "a", "rejected": "b"}, r"without \"prompt\" needs"),
    ({"chosen": [A1], "rejected": [GOOD]}, r"share no opening turn"),
    ({"chosen": [U1, A1], "rejected": [U1]}, r"\"rejected\" must be .* got an empty list"),
    ("[1, 2]", r"a row must be a JSON object"),
    ("{broken", r"not valid JSON"),
])
def test_a_bad_preference_row_is_one_line_naming_file_and_line(tmp_path, row, why):
    with pytest.raises(DataError, match=why) as e:
        _pairs(tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    assert str(e.value).startswith(f"{tmp_path / 'p.jsonl'}:2: ") and "\n" not in str(e.value)


def test_parquet_pairs_read_like_jsonl(tmp_path):
    rows = [{"prompt": [U1], "chosen": [A1], "rejected": [BAD]}, {"prompt": [U2], "chosen": [GOOD], "rejected": [A1]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    got = build_preference_dataset(str(tmp_path / "p.parquet"), ByteTokenizer(), 96, "train", 0, val_fraction=0.0)
    want = _pairs(tmp_path, rows, seq_len=96)
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.labels, want.labels)


# ---------------------------------------------------------------- splits and streams
def _texts(tok, ds):
    return [tok.decode(ds.input_ids[2 * i][ds.segment_ids[2 * i] == 0]) for i in range(len(ds))]


def test_the_held_out_split_is_disjoint_complete_and_the_same_for_every_seed(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "pairs").mkdir()
    path = _jsonl(tmp_path / "pairs" / "p.jsonl", [{"prompt": f"q{i}.", "chosen": "a", "rejected": "b"}
                                                   for i in range(60)])
    split = {s: build_preference_dataset(path, tok, 48, s, 0, val_fraction=0.25) for s in ("train", "val")}
    tr, va = set(_texts(tok, split["train"])), set(_texts(tok, split["val"]))
    assert not tr & va and len(tr | va) == 60 and 5 <= len(va) <= 30
    again = build_preference_dataset(path, tok, 48, "val", 7, val_fraction=0.25)  # another seed, the same rows
    assert torch.equal(again.input_ids, split["val"].input_ids)
    # prompts: the same coin per record, so the same rows are held out
    gpath = _jsonl(tmp_path / "g.jsonl", [{"prompt": f"q{i}.", "answer": str(i)} for i in range(60)])
    gval = build_prompt_dataset(gpath, tok, "val", 3, val_fraction=0.25)
    assert {f"<|im_start|>user\n{t}" for t in gval.texts} == {t.split("<|im_end|>")[0] for t in va}
    vfile = _jsonl(tmp_path / "pairs" / "v.jsonl", [{"prompt": "held", "chosen": "a", "rejected": "b"}] * 3)
    assert len(build_preference_dataset(path, tok, 48, "val", 0, val_name=vfile)) == 3
    folder = str(tmp_path / "pairs")  # p.jsonl and v.jsonl: the held-out file inside it is not trained on
    assert len(build_preference_dataset(folder, tok, 48, "train", 0, val_name=vfile)) == 60
    with pytest.raises(DataError, match="also the held-out data"):
        build_preference_dataset(vfile, tok, 48, "train", 0, val_name=vfile)
    assert len(build_preference_dataset(path, tok, 48, "train", 0, val_fraction=0.0, max_examples=7)) == 7


def _stream(make, steps, start=0, **kw):
    it = make(start_step=start, **kw)
    return [next(it) for _ in range(steps)]


def test_pair_batches_resume_exactly_and_shards_are_disjoint(tmp_path):
    ds = _pairs(tmp_path, [{"prompt": f"q{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(23)], seq_len=32)

    def make(**kw):
        return pair_batches(ds, 3, 5, **kw)
    whole = _stream(make, 12, num_shards=2, shard=1)
    resumed = _stream(make, 5, start=7, num_shards=2, shard=1)  # across an epoch boundary (3 steps per epoch)
    for a, b in zip(whole[7:], resumed):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for a in whole:
        assert a["input_ids"].shape == (6, 32) and torch.equal(a["input_ids"], ds.rows(a["pair_ids"][::2])["input_ids"])
    epoch = [set(b["pair_ids"].tolist()) for s in (0, 1) for b in _stream(make, 3, num_shards=2, shard=s)]
    assert len(set().union(*epoch)) == sum(map(len, epoch)) == 18  # 2 shards x 3 steps x 3 pairs, no pair twice
    with pytest.raises(ConfigError, match="23 preference pairs are too few for 2 replica"):
        pair_batches(ds, 12, 0, num_shards=2)


# ---------------------------------------------------------------- prompts
@pytest.mark.parametrize("family", [*sorted(FAMILIES), "byte"])
def test_prompt_tokens_are_what_sft_puts_before_the_answer(tmp_path, family):
    tok = ByteTokenizer() if family == "byte" else tokenizer(family)
    msgs = [U1, A1, U2]
    path = _jsonl(tmp_path / "g.jsonl", [{"prompt": "What is 2+2?", "answer": "4"}, {"messages": msgs, "answer": 2},
                                         {"prompt": msgs, "answer": "2", "id": 9}])
    for fmt in ("auto", "chatml", "none"):
        ds = build_prompt_dataset(path, tok, "train", 0, chat_format=fmt, val_fraction=0.0)
        assert ds.answers == ["4", "2", "2"] and ds.texts == ["What is 2+2?", U2["content"], U2["content"]]
        resolved = resolve_chat_format(tok, fmt)
        for p, conv in zip(ds.prompts, ([U1], msgs, msgs)):
            ids, labels = _sft(tok, conv, [GOOD], resolved)  # SFT on the same prompt with a real answer
            first = next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)
            assert p == ids[:first]
            if resolved == "template":  # and what a generator is given (the template's generation prompt)
                assert p == list(tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)["input_ids"])
            if family == "byte" and resolved == "chatml" and len(conv) == 1:  # the paper's prompt_text
                assert p == tokenize_chat(tok, conv[0]["content"], "x")[0][:len(p)]


def test_prompt_limits_bad_rows_and_batches(tmp_path, capsys):
    tok = ByteTokenizer()
    rows = [{"prompt": f"question {i}", "answer": str(i)} for i in range(9)] + [{"prompt": "q" * 80, "answer": "1"}]
    path = _jsonl(tmp_path / "g.jsonl", rows)
    with pytest.raises(DataError, match=r"g.jsonl:10: the prompt is \d+ tokens, more than max_prompt_tokens") as e:
        build_prompt_dataset(path, tok, "train", 0, val_fraction=0.0, max_prompt_tokens=64)
    assert "train.seq_len - rl.max_response_tokens = 64" in str(e.value) and "\n" not in str(e.value)
    ds = build_prompt_dataset(path, tok, "train", 0, val_fraction=0.0, skip_bad_rows=True, max_prompt_tokens=64)
    assert len(ds) == 9 and ds.stats["skipped_rows"] == 1 and "skipped 1 bad train prompt" in capsys.readouterr().err
    for row, why in [({"prompt": "q"}, r"needs \"prompt\" \(or \"messages\"\) and \"answer\".*it has: prompt"),
                     ({"prompt": "q", "answer": ["4"]}, r"\"answer\" must be a string .* got a list"),
                     ({"prompt": "q", "answer": True}, r"\"answer\" must be a string .* got a boolean"),
                     ({"prompt": 5, "answer": "4"}, r"\"prompt\" must be a string or a list"),
                     ({"messages": [U1, A1], "answer": "4"}, r"must end with the user turn to answer")]:
        bad = _jsonl(tmp_path / "b.jsonl", [rows[0], row])
        with pytest.raises(DataError, match=why) as e:
            build_prompt_dataset(bad, tok, "train", 0, val_fraction=0.0)
        assert str(e.value).startswith(f"{bad}:2: ") and "\n" not in str(e.value)

    def make(**kw):
        return prompt_batches(ds, 2, 1, **kw)
    whole = _stream(make, 10, num_shards=2, shard=0)
    assert _stream(make, 4, start=6, num_shards=2, shard=0) == whole[6:]
    epoch = [i for s in (0, 1) for b in _stream(make, 2, num_shards=2, shard=s) for i in b]
    assert len(epoch) == len(set(epoch)) == 8 and all(0 <= i < 9 for i in epoch)
    with pytest.raises(ConfigError, match="9 prompts are too few for 3 replica"):
        prompt_batches(ds, 4, 0, num_shards=3)


# ---------------------------------------------------------------- the real tokenizer
@pytest.mark.slow
def test_smollm2s_tokenizer_pairs_and_prompts_match_sft(tmp_path):
    from thinpipe.models.loading import load_tokenizer, model_folder

    tok = load_tokenizer(model_folder("smollm2-135m"))
    fmt = resolve_chat_format(tok, "auto")
    assert fmt == "chatml"
    prompt = [SYSTEM, U1, A1, U2]
    ds = _pairs(tmp_path, [{"prompt": prompt, "chosen": [GOOD], "rejected": [BAD]},
                           {"prompt": "Solve x + 3 = 5.", "chosen": "x = 2.", "rejected": "x = 8."}], tok)
    for row, (p, a) in enumerate([(prompt, [GOOD]), (prompt, [BAD]), ([{"role": "user", "content": "Solve x + 3 = 5."}],
                                                                      [{"role": "assistant", "content": "x = 2."}])]):
        ids, labels = _sft(tok, p, a, fmt)
        assert _real(ds, row) == ids and ds.labels[row, :len(ids)].tolist() == labels
    assert tokenize_chat(tok, "Solve x + 3 = 5.", "x = 2.")[0] == _real(ds, 2)
    path = _jsonl(tmp_path / "g.jsonl", [{"prompt": "Solve x + 3 = 5.", "answer": "2"}])
    got = build_prompt_dataset(path, tok, "train", 0, val_fraction=0.0).prompts[0]
    ids, mask = tokenize_chat(tok, "Solve x + 3 = 5.", "x = 2.")
    assert got == ids[:mask.index(True)]
