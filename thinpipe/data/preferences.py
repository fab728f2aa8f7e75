"""Preference pairs for DPO from a user's files, tokenized exactly as SFT tokenizes the same exchange.

Row formats (Hugging Face TRL's preference dataset formats, DPOTrainer docs)::

    {"prompt": "...", "chosen": "...", "rejected": "..."}                  standard, text
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   standard, conversational
    {"chosen": [messages], "rejected": [messages]}                         implicit prompt: the opening turns
                                                                           both conversations share

A text prompt is one user turn and a text answer one assistant turn, as rows.py reads
``{"prompt", "response"}``; other keys (scores, ids) are ignored. A conversational prompt must not end
with an assistant turn; an answer must end with one.

Tokens: prompt + answer are one conversation rendered with ``data.chat_format`` by
``chat.tokenize_messages``, so the ids and the loss mask are SFT's for that exchange. The completion
is the answer's loss tokens (its end-of-turn marker or EOS included, as SFT trains on it); the prompt
is every token before the first of them. DPO's log pi(y | x) (Rafailov et al. 2023, eq. 7) is then
summed over exactly the tokens SFT would have learned. A sequence longer than ``seq_len`` loses the
end of its completion (TRL's ``max_length`` with ``truncation_mode = "keep_start"``); a prompt that
leaves no completion token is a one-line error, or a counted skip with ``data.skip_bad_rows``.

Splits follow user_data.py: ``data.val_name`` files, or the per-row coin ``in_val`` of
``data.val_fraction``, here counted over every record of the files (a row that turns bad and is
skipped does not move the other rows between splits). The data is small (pairs, not a corpus to
pack), so it is built in memory each run, with no cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from thinpipe.config import ConfigError
from thinpipe.console import say

from .chat import resolve_chat_format, tokenize_messages
from .loader import batches
from .packing import IGNORE_INDEX, PAD_SEGMENT
from .rows import ROLES, DataError, _records, data_files
from .user_data import in_val

ANSWERS = ("chosen", "rejected")


# ---------------------------------------------------------------- files and splits (shared with prompts.py)
def split_records(path: str, split: str, val_name: str, val_fraction: float) -> Iterator[tuple[str, object, bool]]:
    """(where, record, in this split) of every record the split's files hold, in file order. Records of
    the other split come too, so that a malformed row is reported whichever split it falls in."""
    if val_name:
        held = data_files(val_name)
        if split == "val":
            files = held
        else:
            keep = {f.resolve() for f in held}
            files = [f for f in data_files(path) if f.resolve() not in keep]
            if not files:
                raise DataError(f"{path}: every file there is also the held-out data (data.val_name): give "
                                "training files that are not the held-out ones")
        for f in files:
            for where, rec in _records(f):
                yield where, rec, True
        return
    k = 0
    for f in data_files(path):
        for where, rec in _records(f):
            yield where, rec, in_val(k, val_fraction) == (split == "val")
            k += 1


def kind(value) -> str:
    """What a JSON value is, for an error message."""
    if isinstance(value, list) and not value:
        return "an empty list"
    if isinstance(value, str) and not value:
        return "an empty string"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def check_messages(value, where: str, name: str) -> list[dict]:
    """A checked, non-empty list of {"role", "content"} messages (rows.py's rules)."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: \"{name}\" must be a string or a non-empty list of {{\"role\", \"content\"}} "
                        f"messages, got {kind(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {name}[{i}] must be an object with string \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: {name}[{i}] has role {m['role']!r}; roles are {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def as_prompt(value, where: str, name: str = "prompt") -> list[dict]:
    """A prompt: a string (one user turn) or messages not ending with an assistant turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    msgs = check_messages(value, where, name)
    if msgs[-1]["role"] == "assistant":
        raise DataError(f"{where}: \"{name}\" ends with an assistant turn: the answer follows the prompt, so end "
                        "the prompt with the user turn it answers")
    return msgs


def as_answer(value, where: str, name: str) -> list[dict]:
    """An answer: a non-empty string (one assistant turn) or messages ending with a non-empty assistant turn."""
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: \"{name}\" is an empty string: there is no answer to score")
        return [{"role": "assistant", "content": value}]
    msgs = check_messages(value, where, name)
    if msgs[-1]["role"] != "assistant" or not msgs[-1]["content"]:
        raise DataError(f"{where}: \"{name}\" must end with a non-empty assistant turn (the answer to score)")
    return msgs


def parse_pair(obj, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of one record; ``DataError`` naming ``where`` otherwise."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {kind(obj)}")
    obj = {k: v for k, v in obj.items() if v is not None}  # a Parquet column another row format fills
    if not all(a in obj for a in ANSWERS):
        keys = ", ".join(sorted(map(str, obj))) or "none"
        raise DataError(f"{where}: a preference row needs \"prompt\", \"chosen\" and \"rejected\" (it has: {keys})")
    chosen, rejected = obj["chosen"], obj["rejected"]
    if "prompt" in obj:
        return as_prompt(obj["prompt"], where), as_answer(chosen, where, "chosen"), as_answer(rejected, where,
                                                                                               "rejected")
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise DataError(f"{where}: a row without \"prompt\" needs \"chosen\" and \"rejected\" as conversations that "
                        "share their opening turns (the implicit prompt); add \"prompt\"")
    chosen, rejected = check_messages(chosen, where, "chosen"), check_messages(rejected, where, "rejected")
    k = 0  # TRL's extract_prompt: the longest shared prefix ...
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    while k and chosen[k - 1]["role"] == "assistant":  # ... less trailing assistant turns: answers start with one
        k -= 1
    if not k:
        raise DataError(f"{where}: \"chosen\" and \"rejected\" share no opening turn, so the prompt is unknown: add "
                        "\"prompt\"")
    return chosen[:k], as_answer(chosen[k:], where, "chosen"), as_answer(rejected[k:], where, "rejected")


# ---------------------------------------------------------------- tokens
def tokenize_exchange(tokenizer, prompt: list[dict], answer: list[dict], fmt: str,
                      where: str) -> tuple[list[int], list[int], int]:
    """SFT's ids of ``prompt + answer`` (chat.tokenize_messages, format ``fmt``), the labels (the ids of the
    answer's loss tokens, -100 elsewhere) and the index of the answer's first loss token (len(ids) if none).
    Loss tokens of assistant turns inside the prompt are the prompt's, not the answer's."""
    from jinja2.exceptions import TemplateError

    try:
        ids, mask = tokenize_messages(tokenizer, prompt + answer, fmt)
        earlier = (sum(tokenize_messages(tokenizer, prompt, fmt)[1])
                   if any(m["role"] == "assistant" for m in prompt) else 0)
    except (TemplateError, ConfigError) as e:  # e.g. Mistral's template refuses a system turn
        raise DataError(f"{where}: the model's chat template refuses this conversation ({e}): fix the row, set "
                        "data.chat_format = chatml, or data.skip_bad_rows = true") from None
    answer_pos = [i for i, m in enumerate(mask) if m][earlier:]
    labels = [IGNORE_INDEX] * len(ids)
    for i in answer_pos:
        labels[i] = ids[i]
    return ids, labels, answer_pos[0] if answer_pos else len(ids)


@dataclass
class PairDataset:
    """Preference pairs as rows of ``seq_len``: row 2i is pair i's chosen answer, row 2i + 1 its rejected one.

    ``labels`` are the completion's ids (-100 on prompt and padding); ``segment_ids`` 0 on real tokens and -1
    on the right padding (the tokenizer's pad id), as packing.py lays out a row holding one document."""

    input_ids: torch.Tensor    # (2N, seq_len) int64
    labels: torch.Tensor       # (2N, seq_len) int64
    segment_ids: torch.Tensor  # (2N, seq_len) int64
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0] // 2

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def __getitem__(self, index) -> dict[str, torch.Tensor]:
        return self.rows(index)

    def rows(self, index) -> dict[str, torch.Tensor]:
        """Pairs ``index`` (an int, slice, list or index tensor of pair indices) as (2k, seq_len) rows in pair
        order, chosen before rejected, and ``pair_ids`` (2k,): the pair each row belongs to."""
        pairs = torch.arange(len(self))[index].reshape(-1)  # also resolves negative indices
        r = torch.stack([2 * pairs, 2 * pairs + 1], dim=1).reshape(-1)
        return {"input_ids": self.input_ids[r], "labels": self.labels[r], "segment_ids": self.segment_ids[r],
                "pair_ids": pairs.repeat_interleave(2)}


def pad_id_of(tokenizer) -> int:
    """What rows are padded with: the tokenizer's pad id, else its EOS (as loader.build_dataset pads)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = getattr(tokenizer, "eos_token_id", None) if pad is None else pad
    if pad is None:
        raise ValueError("tokenizer has neither pad_token_id nor eos_token_id to pad rows with")
    return pad


def _pair_rows(path, tokenizer, seq_len, split, fmt, val_name, val_fraction, skip, max_examples, skipped, stats):
    """Per kept pair: its two (ids, labels) sequences, cut to ``seq_len``."""
    taken = 0
    for where, rec, mine in split_records(path, split, val_name, val_fraction):
        if max_examples and taken >= max_examples:
            return
        try:
            if isinstance(rec, DataError):
                raise rec
            prompt, chosen, rejected = parse_pair(rec, where)
            if not mine:
                continue
            pair, cut = [], False
            for name, answer in zip(ANSWERS, (chosen, rejected)):
                ids, labels, start = tokenize_exchange(tokenizer, prompt, answer, fmt, where)
                if start == 0:
                    raise DataError(f"{where}: the \"{name}\" answer starts the sequence, so nothing predicts its "
                                    "first token: give a non-empty prompt")
                if start >= min(len(ids), seq_len):
                    raise DataError(f"{where}: the prompt takes {start} tokens of train.seq_len = {seq_len}, "
                                    f"leaving none for the \"{name}\" answer: raise train.seq_len, shorten the "
                                    "prompt, or set data.skip_bad_rows = true")
                cut |= len(ids) > seq_len
                pair.append((ids[:seq_len], labels[:seq_len]))
        except DataError as e:
            if not skip:
                raise
            skipped.append(str(e))
            continue
        stats["num_truncated"] += cut
        taken += 1
        yield pair


def build_preference_dataset(path: str, tokenizer, seq_len: int, split: str, seed: int, chat_format: str = "auto",
                             val_name: str = "", val_fraction: float = 0.05, skip_bad_rows: bool = False,
                             max_examples: int | None = None) -> PairDataset:
    """The preference pairs of one split of a user's files (module doc), in file order.

    ``seed`` is taken for the call shape of ``loader.build_dataset``: nothing here is random (the
    held-out coin is ``SPLIT_SEED``'s and the order is the files'; ``pair_batches`` shuffles).
    ``max_examples`` (None or 0 = all) keeps the split's first pairs."""
    del seed
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (a prompt token and an answer token), got {seq_len}")
    fmt = resolve_chat_format(tokenizer, chat_format)
    pad = pad_id_of(tokenizer)
    skipped: list[str] = []
    stats = {"num_truncated": 0}
    seqs = [s for pair in _pair_rows(path, tokenizer, seq_len, split, fmt, val_name, val_fraction, skip_bad_rows,
                                     max_examples, skipped, stats) for s in pair]
    input_ids = torch.full((len(seqs), seq_len), pad, dtype=torch.long)
    labels = torch.full((len(seqs), seq_len), IGNORE_INDEX, dtype=torch.long)
    segment_ids = torch.full((len(seqs), seq_len), PAD_SEGMENT, dtype=torch.long)
    for r, (ids, lab) in enumerate(seqs):
        input_ids[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[r, :len(ids)] = torch.tensor(lab, dtype=torch.long)
        segment_ids[r, :len(ids)] = 0
    stats.update(num_pairs=len(seqs) // 2, skipped_rows=len(skipped), num_tokens=int((segment_ids == 0).sum()),
                 num_loss_tokens=int((labels != IGNORE_INDEX).sum()), source=str(path), split=split, chat_format=fmt)
    name = Path(path).name
    if skipped:
        say(f"[thinpipe] data: skipped {len(skipped)} bad {split} preference row(s) of {name} (data.skip_bad_rows); "
            f"first: {skipped[0]}")
    if stats["num_truncated"]:
        say(f"[thinpipe] data: {stats['num_truncated']} of {stats['num_pairs']} {split} pairs of {name} are longer "
            f"than train.seq_len = {seq_len}: their answers were cut to fit")
    if not seqs:
        what = ("data.val_fraction held out no rows: raise it or give data.val_name" if split == "val" and not val_name
                else f"no {split} preference pairs")
        raise DataError(f"{path}: {what}")
    return PairDataset(input_ids, labels, segment_ids, stats)


def pair_batches(ds: PairDataset, batch_size: int, seed: int, shard: int = 0, num_shards: int = 1,
                 start_step: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Infinite iterator of ``ds.rows(...)`` dicts of ``batch_size`` pairs ((2 batch_size, seq_len) tensors):
    loader.batches' deterministic order over pairs (epoch permutations seeded by (seed, epoch), disjoint
    contiguous blocks per shard), so the batch of step s is the same whether or not the run resumed at s."""
    if batch_size >= 1 and num_shards >= 1 and len(ds) // num_shards < batch_size:
        raise ConfigError(f"{len(ds)} preference pairs are too few for {num_shards} replica(s) x {batch_size} pairs "
                          "per batch: lower train.batch_size or give more pairs")
    return batches(ds, batch_size, seed, shard, num_shards, start_step)
