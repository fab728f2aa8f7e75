"""Chat formatting and tokenization with an assistant-only loss mask.

The paper converts every example to one user turn and one assistant turn in plain ChatML with no
system metadata (App. B.2 / C.1, App. I.1) and computes the loss on assistant tokens only
(App. I.3). We use the ChatML markers of SmolLM2-Instruct, our default model, but deliberately
not its chat template, which would inject a default system prompt ("You are a helpful AI assistant
named SmolLM..."): that turn would cost tokens in every packed document and teach nothing.

    <|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n   <- prompt part, mask False
    {response}<|im_end|>\\n                                         <- response part, mask True

The two parts are tokenized separately and concatenated. The prompt part ends in "\\n" right after a
special token, so no BPE merge can straddle the boundary, and the mask is exact by construction
(no offset mapping needed). The closing "<|im_end|>" is in the loss so the model learns to stop;
the trailing "\\n" goes with it so that consecutive packed documents stay valid ChatML.
"""

from __future__ import annotations

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def prompt_text(prompt: str) -> str:
    """The user turn plus the assistant header: exactly what a generator is conditioned on."""
    return f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n"


def response_text(response: str) -> str:
    """The assistant turn's body and its end marker: exactly what the loss is computed on."""
    return f"{response}{IM_END}\n"


def _encode(tokenizer, text: str) -> list[int]:
    # Both HF tokenizers and ByteTokenizer take add_special_tokens; False keeps HF from adding a BOS
    # (SmolLM2 adds none anyway) while still mapping "<|im_start|>" text to its single special id.
    return list(tokenizer.encode(text, add_special_tokens=False))


def tokenize_chat(tokenizer, prompt: str, response: str) -> tuple[list[int], list[bool]]:
    """Token ids of one ChatML exchange and its loss mask (True = response token, incl. <|im_end|>)."""
    p_ids = _encode(tokenizer, prompt_text(prompt))
    r_ids = _encode(tokenizer, response_text(response))
    return p_ids + r_ids, [False] * len(p_ids) + [True] * len(r_ids)
