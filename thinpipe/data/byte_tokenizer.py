"""A byte-level tokenizer for the tiny random-init test models (vocab 512).

Why it exists: unit tests and demos need a tokenizer that loads instantly, needs no download and
round-trips any text exactly, so that a test can decode the loss-masked tokens and compare them with
the response text byte for byte. Ids 0..255 are the raw UTF-8 bytes; the ChatML markers are single
ids so the chat format of the real model (SmolLM2-Instruct) works unchanged at byte level.

Id layout (vocab_size = 512, a multiple of 64 like real vocabularies):

    0..255  bytes
    256     <|im_start|>   (bos_token_id, as in SmolLM2)
    257     <|im_end|>     (eos_token_id, as in SmolLM2: ends every assistant turn)
    258     <|endoftext|>
    259     <|pad|>        (pad_token_id; distinct from eos so that padding bugs show up in tests)
    260..511 reserved, never produced by `encode`; `decode` renders them as U+FFFD
"""

from __future__ import annotations

import re
from collections.abc import Iterable

SPECIAL_TOKENS: dict[str, int] = {
    "<|im_start|>": 256,
    "<|im_end|>": 257,
    "<|endoftext|>": 258,
    "<|pad|>": 259,
}
MARKER = "thinpipe_byte_tokenizer.json"  # in a model folder: its tokenizer is this one
_ID_TO_SPECIAL = {i: s for s, i in SPECIAL_TOKENS.items()}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")


class ByteTokenizer:
    """UTF-8 bytes + ChatML specials; the subset of the Hugging Face tokenizer API we use."""

    vocab_size = 512
    bos_token, eos_token, pad_token = "<|im_start|>", "<|im_end|>", "<|pad|>"
    bos_token_id = SPECIAL_TOKENS[bos_token]
    eos_token_id = SPECIAL_TOKENS[eos_token]
    pad_token_id = SPECIAL_TOKENS[pad_token]

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in `text` become their single ids, all else its UTF-8 bytes.

        `add_special_tokens` is accepted for signature compatibility and adds nothing, exactly
        like SmolLM2's tokenizer (which prepends no BOS): the chat format carries the markers.
        """
        del add_special_tokens
        ids: list[int] = []
        for piece in _SPECIAL_RE.split(text):
            if piece in SPECIAL_TOKENS:
                ids.append(SPECIAL_TOKENS[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Inverse of `encode`. Byte runs are decoded together so multi-byte characters survive;
        invalid UTF-8 (possible from a random model) becomes U+FFFD instead of raising."""
        if hasattr(ids, "tolist"):  # torch / numpy
            ids = ids.tolist()
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
            if i in _ID_TO_SPECIAL:
                if not skip_special_tokens:
                    out.append(_ID_TO_SPECIAL[i])
            elif 0 <= i < self.vocab_size:
                out.append("\ufffd")
            else:
                raise ValueError(f"token id {i} outside vocab of size {self.vocab_size}")
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def save_pretrained(self, folder) -> None:
        """Mark a model folder as using this tokenizer (``load_tokenizer`` reads the marker), so that an
        exported run of a random preset loads again, e.g. as ``train --init-from``'s weights."""
        import json
        from pathlib import Path

        marker = {"tokenizer": "thinpipe.ByteTokenizer", "vocab_size": 512}
        (Path(folder) / MARKER).write_text(json.dumps(marker) + "\n")

    def convert_tokens_to_ids(self, token: str) -> int:
        """Id of a special token (HF-compatible name); ValueError for anything else."""
        if token not in SPECIAL_TOKENS:
            raise ValueError(f"{token!r} is not a special token; known: {sorted(SPECIAL_TOKENS)}")
        return SPECIAL_TOKENS[token]
