"""Test doubles: a tiny char-level tokenizer with two kinds of merges and fixed-logit models."""

from __future__ import annotations

import torch

V = 512


class CharTokenizer:
    """ASCII chars -> 2..129; ' '+char -> 130..257 (GPT-style leading-space tokens);
    a doubled letter ('ll') -> 258..385.  bos=0, eos=1.  ``add_special_tokens`` prepends bos."""

    bos_token_id = 0
    eos_token_id = 1

    @staticmethod
    def _c(ch: str) -> int:
        o = ord(ch)
        return o if o < 128 else ord("?")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        i = 0
        while i < len(text):
            ch = text[i]
            nxt = text[i + 1] if i + 1 < len(text) else ""
            if ch == " " and nxt and nxt != " ":
                ids.append(130 + self._c(nxt))
                i += 2
            elif ch.isalpha() and nxt == ch:
                ids.append(258 + self._c(ch))
                i += 2
            else:
                ids.append(2 + self._c(ch))
                i += 1
        return ids


def constant_logits_fn(weights: torch.Tensor):
    """logits_fn whose next-token distribution is the same everywhere: softmax(weights)."""

    def fn(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        assert ids.shape == mask.shape and ids.dtype == torch.long
        return weights.expand(ids.shape[0], ids.shape[1], -1).clone()

    return fn
