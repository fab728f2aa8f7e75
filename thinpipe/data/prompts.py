"""Prompts with a reference answer, for RL with verifiable rewards (GSPO / GRPO rollouts), from a user's files.

Row formats::

    {"prompt": "...", "answer": "..."}                 one user turn (also "prompt" as a list of messages)
    {"messages": [...], "answer": "..."}               a conversation ending with the user turn to answer

``answer`` is the reference a reward function checks a rollout against (a JSON number is read as its
text); other keys are ignored.

A prompt's tokens are what SFT puts before an assistant answer to the same conversation: the
conversation plus an (empty) assistant turn goes through ``chat.tokenize_messages`` with
``data.chat_format``, and the prompt is every token before that turn's first loss token. With a
template that is the conversation rendered with its generation prompt (``add_generation_prompt``),
with ``chatml`` the turns and ``<|im_start|>assistant\\n``, with ``none`` the turns' text back to back;
each after the tokenizer's BOS where SFT puts one. So a rollout continues exactly where SFT trained
the model to start answering.

Splits follow preferences.py (``data.val_name``, or the ``data.val_fraction`` coin over every record).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from thinpipe.config import ConfigError
from thinpipe.console import say

from .chat import resolve_chat_format
from .loader import batches
from .preferences import as_prompt, check_messages, kind, split_records, tokenize_exchange
from .rows import DataError

PROMPT_LIMIT = "max_prompt_tokens = train.seq_len - rl.max_response_tokens"  # what bounds a prompt in a GSPO run


@dataclass
class PromptDataset:
    """Prompt i: ``prompts[i]`` (token ids the model answers from), ``answers[i]`` (the reference) and
    ``texts[i]`` (the prompt's text: the prompt string, or the last user turn of a conversation)."""

    prompts: list[list[int]]
    answers: list[str]
    texts: list[str]
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)


def parse_prompt(obj, where: str) -> tuple[list[dict], str, str]:
    """(messages, answer, text) of one record; ``DataError`` naming ``where`` otherwise."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {kind(obj)}")
    obj = {k: v for k, v in obj.items() if v is not None}
    if "answer" not in obj or not ("prompt" in obj or "messages" in obj):
        keys = ", ".join(sorted(map(str, obj))) or "none"
        raise DataError(f"{where}: a prompt row needs \"prompt\" (or \"messages\") and \"answer\", the reference a "
                        f"reward checks (it has: {keys})")
    answer = obj["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: \"answer\" must be a string (or a number), got {kind(answer)}")
    if "messages" in obj:
        msgs = check_messages(obj["messages"], where, "messages")
        if msgs[-1]["role"] != "user":
            raise DataError(f"{where}: \"messages\" must end with the user turn to answer, not a "
                            f"{msgs[-1]['role']} turn")
        return msgs, str(answer), msgs[-1]["content"]
    prompt = obj["prompt"]
    if not isinstance(prompt, (str, list)):
        raise DataError(f"{where}: \"prompt\" must be a string or a list of {{\"role\", \"content\"}} messages, got "
                        f"{kind(prompt)}")
    msgs = as_prompt(prompt, where)
    return msgs, str(answer), prompt if isinstance(prompt, str) else msgs[-1]["content"]


def prompt_tokens(tokenizer, messages: list[dict], fmt: str, where: str = "prompt") -> list[int]:
    """The ids SFT puts before an assistant answer to ``messages`` (module doc)."""
    ids, _, start = tokenize_exchange(tokenizer, messages, [{"role": "assistant", "content": ""}], fmt, where)
    return ids[:start]


def build_prompt_dataset(path: str, tokenizer, split: str, seed: int, chat_format: str = "auto", val_name: str = "",
                         val_fraction: float = 0.05, skip_bad_rows: bool = False, max_examples: int | None = None,
                         max_prompt_tokens: int | None = None, *, limit_name: str = PROMPT_LIMIT) -> PromptDataset:
    """The prompts of one split of a user's files, in file order. ``seed`` is taken for the call shape of
    ``loader.build_dataset`` (nothing here is random; ``prompt_batches`` shuffles). ``max_examples`` (None or
    0 = all) keeps the split's first prompts; a prompt of more than ``max_prompt_tokens`` tokens (None or 0 =
    no limit; ``limit_name`` says in errors which setting that is) is an error, or skipped and counted with
    ``skip_bad_rows``."""
    del seed
    fmt = resolve_chat_format(tokenizer, chat_format)
    out = PromptDataset([], [], [])
    skipped: list[str] = []
    for where, rec, mine in split_records(path, split, val_name, val_fraction):
        if max_examples and len(out) >= max_examples:
            break
        try:
            if isinstance(rec, DataError):
                raise rec
            msgs, answer, text = parse_prompt(rec, where)
            if not mine:
                continue
            ids = prompt_tokens(tokenizer, msgs, fmt, where)
            if not ids:
                raise DataError(f"{where}: the prompt is empty (no tokens): give a non-empty prompt")
            if max_prompt_tokens and len(ids) > max_prompt_tokens:
                raise DataError(f"{where}: the prompt is {len(ids)} tokens, more than {limit_name} = "
                                f"{max_prompt_tokens}: raise that limit, shorten the prompt, or set "
                                "data.skip_bad_rows = true")
        except DataError as e:
            if not skip_bad_rows:
                raise
            skipped.append(str(e))
            continue
        out.prompts.append(ids)
        out.answers.append(answer)
        out.texts.append(text)
    out.stats = {"num_prompts": len(out), "skipped_rows": len(skipped), "num_tokens": sum(map(len, out.prompts)),
                 "source": str(path), "split": split, "chat_format": fmt}
    if skipped:
        say(f"[thinpipe] data: skipped {len(skipped)} bad {split} prompt row(s) of {Path(path).name} "
            f"(data.skip_bad_rows); first: {skipped[0]}")
    if not len(out):
        what = ("data.val_fraction held out no rows: raise it or give data.val_name" if split == "val" and not val_name
                else f"no {split} prompts")
        raise DataError(f"{path}: {what}")
    return out


class _Indices:
    """What loader.batches reads of a dataset: its length, and rows(idx) (here the indices themselves)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def rows(self, idx: torch.Tensor) -> list[int]:
        return idx.tolist()


def prompt_batches(ds: PromptDataset, prompts_per_step: int, seed: int, shard: int = 0, num_shards: int = 1,
                   start_step: int = 0) -> Iterator[list[int]]:
    """Infinite iterator of lists of ``prompts_per_step`` prompt indices: loader.batches' deterministic order
    (epoch permutations seeded by (seed, epoch), disjoint contiguous blocks per shard), so step s gives the
    same prompts whether or not the run resumed at s."""
    if prompts_per_step >= 1 and num_shards >= 1 and len(ds) // num_shards < prompts_per_step:
        raise ConfigError(f"{len(ds)} prompts are too few for {num_shards} replica(s) x {prompts_per_step} prompts per "
                        "step: lower rl.prompts_per_step or give more prompts")
    return batches(_Indices(len(ds)), prompts_per_step, seed, shard, num_shards, start_step)
