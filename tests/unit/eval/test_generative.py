"""Generative evaluation: the sandbox, answer extraction, program assembly, greedy decoding."""

import json
import os
import time

import pytest

from tests.helpers import skip_or_fail, tiny_model
from thinpipe.eval.generative import (
    greedy_generate,
    gsm8k_correct,
    gsm8k_extract,
    humaneval_program,
    load_generative,
    logits_generate,
    mbpp_program,
    truncate_at_stop,
)
from thinpipe.eval.loglik import logits_fn_from_model
from thinpipe.eval.sandbox import SandboxUnavailable, run_sandboxed
from thinpipe.eval.wheels import WheelUnavailable


def sandboxed(code, **kw):
    try:
        return run_sandboxed(code, **kw)
    except SandboxUnavailable as e:  # no root and no user namespaces: nothing may run
        pytest.skip(str(e))


def items(task, limit):
    try:
        return load_generative(task, limit)
    except WheelUnavailable as e:
        skip_or_fail(f"benchmark wheel not available: {e}")


def test_sandbox_kills_a_looping_program_at_its_timeout():
    t0 = time.perf_counter()
    r = sandboxed("import os\nos.fork()\nwhile True:\n    pass\n", timeout_s=1.5)
    assert r.status == "timeout" and time.perf_counter() - t0 < 5


def test_sandbox_cannot_write_outside_its_scratch_directory_nor_reach_the_network(tmp_path):
    import socket

    target = tmp_path / "escaped.txt"
    with socket.socket() as listener:  # the host's loopback: the sandbox has a network namespace of its own
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        code = (f"open('inside.txt', 'w').write('ok')\n"
                f"try:\n    open({str(target)!r}, 'w').write('x')\n    print('WROTE OUTSIDE')\n"
                f"except OSError as e:\n    print('denied', e.errno)\n"
                f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                f"    print('NETWORK')\nexcept OSError:\n    print('no network')\n")
        r = sandboxed(code)
    assert r.status == "passed", r.output_tail
    # ENOENT: the host's directories are not in the sandbox at all (EROFS: read-only), see test_sandbox.py
    assert ("denied 2\n" in r.output_tail or "denied 30" in r.output_tail) and "no network" in r.output_tail
    assert not target.exists()
    assert "WROTE OUTSIDE" not in r.output_tail and "NETWORK" not in r.output_tail.replace("no network", "")


def test_sandbox_reports_failures_and_memory_limits():
    assert sandboxed("assert 1 + 1 == 2\n").status == "passed"
    assert sandboxed("assert 1 + 1 == 3\n").status == "failed"
    r = sandboxed("x = bytearray(8 << 30)\n", memory_mb=512)
    assert r.status == "failed" and "MemoryError" in r.output_tail


@pytest.mark.parametrize("completion, answer, ok", [
    (" She has 23 - 15 = 8. So the answer is 8.", "8", True),
    (" So the answer is $1,000.", "1000", True),
    (" The total is 12 apples and then 18", "18", True),      # no "answer is": the last number
    (" So the answer is 7.", "8", False),
    (" I do not know.", "3", False),
])
def test_gsm8k_answer_extraction(completion, answer, ok):
    assert gsm8k_correct(completion, {"short_answer": answer}) is ok


def test_gsm8k_extract_normalizes_like_olmes():
    assert gsm8k_extract("#### 1,234.") == "1234"
    assert gsm8k_extract("the answer is -5") == "-5"


def test_truncate_at_the_first_stop_sequence():
    assert truncate_at_stop("a\nb\n\nQuestion: c", ["Question:", "\n\n"]) == "a\nb"
    assert truncate_at_stop("abc", ["x"]) == "abc"


def test_canonical_solutions_pass_and_wrong_ones_fail_in_the_sandbox():
    he = items("humaneval", 3)
    mb = items("mbpp", 3)
    assert len(load_generative("gsm8k", 5)) == 5 and all("Question:" in i.prompt for i in load_generative("gsm8k", 2))
    for item in he:
        assert sandboxed(humaneval_program(item.doc["canonical_solution"], item.doc)).status == "passed", item.item_id
        assert sandboxed(humaneval_program("    return None\n", item.doc)).status == "failed"
    for item in mb:
        assert sandboxed(mbpp_program(item.doc["code"], item.doc)).status == "passed", item.item_id
        assert sandboxed(mbpp_program("def nothing():\n    pass\n", item.doc)).status == "failed"


def test_greedy_generation_with_the_kv_cache_equals_the_uncached_loop():
    from thinpipe.data.byte_tokenizer import ByteTokenizer

    model, tok = tiny_model("llama").eval(), ByteTokenizer()
    prompt = "Question: 2 + 2 = ?\nAnswer:"
    cached = greedy_generate(model, tok, prompt, ["\n\n\n\n"], 24)
    plain = logits_generate(logits_fn_from_model(model))(model, tok, prompt, ["\n\n\n\n"], 24)
    assert cached == plain and len(cached) > 0
    # a stop sequence cuts the completion
    first = cached[:3]
    assert greedy_generate(model, tok, prompt, [first[-1]], 24) == truncate_at_stop(cached, [first[-1]])


def test_eval_cli_runs_generative_tasks(tmp_path, capsys):
    from thinpipe.cli import main

    items("gsm8k", 1)
    run = tmp_path / "run"
    sets = ["model.name=tiny-llama", "data.name=synthetic", "train.steps=1", "train.batch_size=2",
            "train.seq_len=32", "data.val_rows=2"]
    assert main(["train", "--out", str(run), "--quiet", *[x for s in sets for x in ("--set", s)]]) == 0
    capsys.readouterr()
    samples = tmp_path / "samples.json"
    try:
        rc = main(["eval", "--model", str(run), "--tasks", "gsm8k,mbpp", "--limit", "2", "--max-new-tokens", "8",
                   "--samples", str(samples)])
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    assert rc == 0
    out = capsys.readouterr().out
    assert "exact_match" in out and "pass@1" in out
    saved = json.loads(samples.read_text())
    assert [r["n"] for r in saved] == [2, 2] and all(len(r["samples"]) == 2 for r in saved)
    assert main(["eval", "--model", str(run), "--tasks", "gsm9k"]) == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="documents the root path")
def test_sandbox_runs_as_root_with_namespaces():
    assert sandboxed("import os; print(os.getpid())").output_tail.strip() == "1"  # its own PID namespace
