"""A user's own data (issue 18): JSONL / Parquet / folders in the three row formats, exact
assistant-only masks with the model's own chat template (Llama-3, Qwen2, Mistral families built
locally), one-line errors naming file and line, streaming packing and the content-keyed cache."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.chat_families import FAMILIES, tokenizer  # noqa: E402
from thinpipe.config import ConfigError  # noqa: E402
from thinpipe.data import (  # noqa: E402
    ByteTokenizer,
    build_dataset,
    resolve_chat_format,
    tokenize_chat,
    tokenize_messages,
    user_data,  # noqa: E402
)
from thinpipe.data.packing import IGNORE_INDEX  # noqa: E402
from thinpipe.data.rows import DataError, read_rows  # noqa: E402

SAMPLE = Path(__file__).parents[2] / "fixtures" / "chat_sample.jsonl"
MULTI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And x + 3 = 5?"},
         {"role": "assistant", "content": "x = 2."}]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("THINPIPE_CACHE", str(tmp_path / "cache"))


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- chat templates
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_template_ids_are_the_templates_and_the_mask_is_exactly_the_assistant_turns(family):
    tok = tokenizer(family)
    msgs = MULTI if family != "mistral" else MULTI[1:]  # Mistral v0.1's template refuses a system turn
    ids, mask = tokenize_messages(tok, msgs, "template")
    assert ids == list(tok.apply_chat_template(msgs, tokenize=True)["input_ids"])
    end = FAMILIES[family][6]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == f"It is 4.{end}x = 2.{end}"
    # the unmasked tokens are everything else: prompts, headers, the system turn
    rest = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "What is 2+2?" in rest and "It is 4." not in rest and "x = 2." not in rest


def test_auto_picks_the_template_except_for_chatml_models_and_template_less_tokenizers():
    assert resolve_chat_format(tokenizer("llama3"), "auto") == "template"
    assert resolve_chat_format(tokenizer("mistral"), "auto") == "template"
    assert resolve_chat_format(tokenizer("qwen2"), "auto") == "chatml"   # ChatML + a default system prompt
    assert resolve_chat_format(ByteTokenizer(), "auto") == "chatml"
    with pytest.raises(ConfigError, match="has no chat template"):
        resolve_chat_format(ByteTokenizer(), "template")
    with pytest.raises(ConfigError, match="chat_format"):
        resolve_chat_format(ByteTokenizer(), "jinja")


def test_chatml_single_turn_is_the_papers_format_and_multi_turn_masks_every_assistant_turn():
    tok = ByteTokenizer()
    one = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert tokenize_messages(tok, one, "chatml") == tokenize_chat(tok, "q", "a")
    ids, mask = tokenize_messages(tok, MULTI, "chatml")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "It is 4.<|im_end|>\nx = 2.<|im_end|>\n"
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_none_format_has_no_markers_and_ends_assistant_turns_with_eos():
    tok = tokenizer("llama3")
    ids, mask = tokenize_messages(tok, MULTI[1:3], "none")
    assert tok.decode(ids) == "<|begin_of_text|>What is 2+2?It is 4.<|eot_id|>"  # the tokenizer's BOS first
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "It is 4.<|eot_id|>"


def test_an_answer_token_straddling_the_generation_prompt_is_learned_and_bos_leads_chatml():
    tok = tokenizer("llama3")
    tok.chat_template = ("{% for m in messages %}{{ m['role'].upper() + ': ' + m['content'] + '\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}ASSISTANT: {% endif %}")
    ids, mask = tokenize_messages(tok, MULTI[1:3], "template")
    assert tok.decode([i for i, m in zip(ids, mask) if m]).strip() == "It is 4.\n".strip()  # " It" counts
    with pytest.raises(ConfigError, match="starts with an assistant turn"):
        tokenize_messages(tok, MULTI[2:3], "template")
    ids, mask = tokenize_messages(tokenizer("llama3"), MULTI[1:3], "chatml")  # a BOS-adding tokenizer
    assert ids[0] == tokenizer("llama3").bos_token_id and not mask[0]


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = tokenizer("llama3")
    # drops every assistant turn but the last (as reasoning templates do with their thoughts)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                         "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ConfigError, match="rewrites earlier turns"):
        tokenize_messages(tok, MULTI, "template")


# ---------------------------------------------------------------- files and rows
def test_the_three_row_formats_and_parquet_read_the_same(tmp_path):
    rows = [{"messages": MULTI}, {"prompt": "p", "response": "r"}, {"prompt": "p", "completion": "c"},
            {"text": "plain text"}]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist([{"messages": MULTI}, {"messages": MULTI[1:3]}]), tmp_path / "e.parquet")
    got = list(read_rows(tmp_path / "d.jsonl"))
    assert got[0].messages == tuple(MULTI) and got[1].messages[1]["content"] == "r"
    assert got[2].messages[1]["content"] == "c" and got[3].text == "plain text"
    assert [r.messages for r in read_rows(tmp_path / "e.parquet")] == [tuple(MULTI), tuple(MULTI[1:3])]
    folder = list(read_rows(tmp_path))  # a folder: both files, in name order
    assert len(folder) == 6 and folder[-1].where.endswith("e.parquet:row 2")


@pytest.mark.parametrize("line,why", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "must be a JSON object"),
    ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant turn"),
    ('{"messages": [{"role": "robot", "content": "q"}]}', "has role 'robot'"),
    ('{"messages": [{"role": "user"}]}', "string \\\"role\\\" and \\\"content\\\""),
    ('{"prompt": "q"}', "needs string \\\"prompt\\\" and \\\"response\\\""),
    ('{"text": ""}', "non-empty string"),
    ('{"question": "q", "answer": "a"}', "it has: answer, question"),
])
def test_a_malformed_row_names_its_file_and_line(tmp_path, line, why):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "response": "r"}, "", line])
    with pytest.raises(DataError, match=why) as e:
        list(read_rows(path))
    assert str(e.value).startswith(f"{path}:3: ")


def test_bytes_that_are_not_utf8_or_parquet_are_one_line_errors(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text"):
        list(read_rows(path))
    fake = tmp_path / "fake.parquet"
    fake.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        list(read_rows(fake))


def test_skip_bad_rows_counts_and_lists_them(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(8)]
                        + ["{broken", {"text": 3}])
    ds = build_dataset(str(path), ByteTokenizer(), 64, "train", 0, val_fraction=0.0, skip_bad_rows=True)
    assert ds.stats["skipped_rows"] == 2 and ds.stats["num_packed"] == 8
    assert "skipped 2 malformed train row(s)" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"d.jsonl:9: not valid JSON"):
        build_dataset(str(path), ByteTokenizer(), 64, "train", 1, val_fraction=0.0)


def test_null_fields_count_as_absent_in_mixed_parquet(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"text": "plain", "messages": None},
                                         {"text": None, "messages": MULTI[1:3]}]), tmp_path / "mixed.parquet")
    got = list(read_rows(tmp_path / "mixed.parquet"))
    assert got[0].text == "plain" and got[1].messages == tuple(MULTI[1:3])


def test_missing_and_wrong_paths_are_one_line_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        build_dataset(str(tmp_path / "nope.jsonl"), ByteTokenizer(), 64, "train", 0)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="not a .jsonl or .parquet"):
        build_dataset(str(tmp_path / "x.csv"), ByteTokenizer(), 64, "train", 0)


# ---------------------------------------------------------------- splits, packing, cache
def test_held_out_fraction_is_seeded_disjoint_and_complete(tmp_path):
    rows = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(200)]
    path = str(_write_jsonl(tmp_path / "d.jsonl", rows))
    tok = ByteTokenizer()
    tr = build_dataset(path, tok, 64, "train", 0, val_fraction=0.2)
    va = build_dataset(path, tok, 64, "val", 0, val_fraction=0.2)
    assert tr.stats["num_packed"] + va.stats["num_packed"] == 200
    assert 20 <= va.stats["num_packed"] <= 60

    def texts(ds):
        return {tok.decode(r[r != tok.pad_token_id].tolist()) for r in ds.input_ids}
    assert not any(f"question {i}<" in t1 and f"question {i}<" in t2 for t1 in texts(tr) for t2 in texts(va)
                   for i in range(200))
    again = build_dataset(path, tok, 64, "val", 0, val_fraction=0.2)
    assert torch.equal(again.input_ids, va.input_ids)
    # another train.seed: the same held-out rows, in the same order (data.val_rows takes a prefix)
    other = build_dataset(path, tok, 64, "val", 1, val_fraction=0.2)
    assert torch.equal(other.input_ids, va.input_ids)
    vfile = str(_write_jsonl(tmp_path / "v.jsonl", rows[:5]))
    assert build_dataset(path, tok, 64, "val", 0, val_name=vfile).stats["num_packed"] == 5
    assert build_dataset(path, tok, 64, "train", 0, val_name=vfile).stats["num_packed"] == 200
    # a held-out file inside the training folder is not trained on; a copy in a hidden folder is not read
    (tmp_path / ".ipynb_checkpoints").mkdir()
    _write_jsonl(tmp_path / ".ipynb_checkpoints" / "d-checkpoint.jsonl", rows)
    assert build_dataset(str(tmp_path), tok, 64, "train", 0, val_name=vfile).stats["num_packed"] == 200
    with pytest.raises(DataError, match="also the held-out data"):
        build_dataset(vfile, tok, 64, "train", 0, val_name=vfile)


def test_text_rows_train_on_every_token_but_the_first(tmp_path):
    path = str(_write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}, {"text": "second document"}]))
    ds = build_dataset(path, ByteTokenizer(), 64, "train", 0, val_fraction=0.0)
    tok = ByteTokenizer()
    ids, labels = ds.rows(0)["input_ids"], ds.rows(0)["labels"]
    assert ds.input_ids.dtype == torch.int32 and ids.dtype == torch.int64  # cached int32, served int64
    docs = ds.stats["num_tokens"]
    assert docs == len("hello world") + 1 + len("second document") + 1  # + EOS each
    assert int((labels != IGNORE_INDEX).sum()) == docs - 2  # all but each document's first token
    assert tok.decode(ids[labels != IGNORE_INDEX].tolist()).count("<|im_end|>") == 2


def test_streaming_windows_pack_every_document_and_the_cache_is_keyed_by_content(tmp_path, monkeypatch):
    rows = [{"prompt": "q" * (i % 13), "response": "a" * (1 + i % 7)} for i in range(50)]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    tok = ByteTokenizer()
    whole = build_dataset(str(path), tok, 48, "train", 0, val_fraction=0.0)
    monkeypatch.setattr(user_data, "WINDOW", 7)  # a corpus "bigger than memory": 8 windows
    packs = []
    real_pack = user_data.pack
    monkeypatch.setattr(user_data, "pack", lambda docs, *a, **k: packs.append(len(docs)) or real_pack(docs, *a, **k))
    windowed = build_dataset(str(path), tok, 48, "train", 1, val_fraction=0.0)  # another seed: another key
    assert packs == [7] * 7 + [1]
    for k in ("num_packed", "num_tokens", "num_loss_tokens"):
        assert windowed.stats[k] == whole.stats[k]
    assert windowed.stats["num_packed"] == 50 and len(windowed) >= len(whole)

    def no_reading(*a, **k):
        raise AssertionError("the cache should have been used")
    monkeypatch.setattr(user_data, "read_rows", no_reading)
    hit = build_dataset(str(path), tok, 48, "train", 0, val_fraction=0.0)
    assert torch.equal(hit.input_ids, whole.input_ids)
    path.write_text(path.read_text().replace("qqq", "QQQ", 1))  # new content: a new key, so it reads again
    with pytest.raises(AssertionError, match="cache should have been used"):
        build_dataset(str(path), tok, 48, "train", 0, val_fraction=0.0)
