"""Chat formatting and tokenization with an assistant-only loss mask (``data.chat_format``).

The paper converts every example to one user turn and one assistant turn in plain ChatML with no
system metadata (App. B.2 / C.1, App. I.1) and computes the loss on assistant tokens only
(App. I.3). A user's own data may be multi-turn and their model may speak another format, so
there are four ways to render a conversation:

- ``chatml``: ChatML markers, no injected system turn (the paper's; SmolLM2-Instruct's markers),
  after the tokenizer's BOS when it adds one (none for SmolLM2)::

      <|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n   <- mask False
      {response}<|im_end|>\\n                                         <- mask True

  Each loss part is tokenized on its own and the parts between are tokenized together; every part
  ends in "\\n" right after a special token, so no BPE merge can straddle a boundary and the mask is
  exact by construction. The closing "<|im_end|>" is in the loss so the model learns to stop.
- ``template``: the tokenizer's own chat template (Llama-3, Mistral, Qwen2, ...). The whole
  conversation is rendered once and tokenized once (exactly the ids ``apply_chat_template``
  gives); an assistant turn's span is the text the template adds when that turn is appended to the
  conversation so far with its generation prompt (``render(msgs[:i+1]) - render(msgs[:i], gen)``,
  which holds the template's end-of-turn marker), and a token is in the loss when it starts in or
  overlaps such a span (offset mapping). A template that rewrites earlier turns (so that those
  renders are not prefixes of each other), and a conversation opening with an assistant turn, are
  refused with a clear error.
- ``none``: the turns' text back to back, no markers (after the tokenizer's BOS, if any); the
  tokenizer's EOS after each assistant turn.
- ``auto`` (default): ``template`` when the tokenizer has one, except for ChatML models (the tokenizer
  has ``<|im_start|>`` as a special token: SmolLM2, Qwen2), whose templates are ChatML plus a default
  system prompt ("You are a helpful AI assistant named SmolLM...") that would cost tokens in every
  packed document and teach nothing: those, and tokenizers without a template, get ``chatml``.

Plain text rows (continual pretraining) are the tokenizer's encoding plus EOS, with every token in
the loss but the first (nothing in the document predicts it; the previous packed document must not).
"""

from __future__ import annotations

from thinpipe.config import ConfigError

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_FORMATS = ("auto", "template", "chatml", "none")


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


# ---------------------------------------------------------------- choosing a format
def _is_chatml_model(tokenizer) -> bool:
    try:
        ids = _encode(tokenizer, IM_START)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it does not have it
        return False
    return len(ids) == 1


def resolve_chat_format(tokenizer, choice: str) -> str:
    """``template``, ``chatml`` or ``none`` for ``data.chat_format = choice`` with this tokenizer."""
    if choice not in CHAT_FORMATS:
        raise ConfigError(f"data.chat_format must be one of {', '.join(CHAT_FORMATS)}, got {choice!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if choice == "template" and not has_template:
        raise ConfigError("data.chat_format = template but this model's tokenizer has no chat template: use auto or "
                          "chatml (ChatML markers) or none (no markers)")
    if choice == "auto":
        return "template" if has_template and not _is_chatml_model(tokenizer) else "chatml"
    return choice


# ---------------------------------------------------------------- the three renderings
def _bos(tokenizer) -> list[int]:
    """What the tokenizer puts before a document (Llama's, Mistral's BOS; nothing for SmolLM2 and
    the byte tokenizer): the chatml and none formats start with it, outside the loss."""
    return [i for i in tokenizer.encode("", add_special_tokens=True)][:1]


def _chatml(tokenizer, messages) -> tuple[list[int], list[bool]]:
    ids: list[int] = _bos(tokenizer)
    mask: list[bool] = [False] * len(ids)
    pending = ""  # text outside the loss, tokenized in one piece (single turn == tokenize_chat)
    for m in messages:
        pending += f"{IM_START}{m['role']}\n"
        if m["role"] != "assistant":
            pending += f"{m['content']}{IM_END}\n"
            continue
        p = _encode(tokenizer, pending)
        r = _encode(tokenizer, response_text(m["content"]))
        ids += p + r
        mask += [False] * len(p) + [True] * len(r)
        pending = ""
    if pending:
        p = _encode(tokenizer, pending)
        ids += p
        mask += [False] * len(p)
    return ids, mask


def _none(tokenizer, messages) -> tuple[list[int], list[bool]]:
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = _bos(tokenizer)
    mask: list[bool] = [False] * len(ids)
    for m in messages:
        t = _encode(tokenizer, m["content"])
        loss = m["role"] == "assistant"
        if loss and eos is not None:
            t = t + [eos]
        ids += t
        mask += [loss] * len(t)
    return ids, mask


def _render(tokenizer, messages, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (see module doc)."""
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if not i:
            raise ConfigError("the conversation starts with an assistant turn: the template's opening (BOS, header) "
                              "would be learned as the answer; start with a user (or system) turn")
        before = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[:i + 1], False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ConfigError("this tokenizer's chat template does not render a conversation's turns as prefixes of "
                              "each other (it rewrites earlier turns), so the assistant tokens cannot be found "
                              "exactly: use data.chat_format = chatml or none")
        spans.append((len(before), len(upto)))
    return full, spans


def _template(tokenizer, messages) -> tuple[list[int], list[bool]]:
    text, spans = assistant_spans(tokenizer, messages)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):
        raise ConfigError("data.chat_format = template needs a fast tokenizer (one with offset mappings): use "
                          "chatml or none") from None
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    # a token is learned when its text starts in an assistant span or overlaps one (a generation
    # prompt ending in a space: the answer's first token "ĠThe" starts one character early)
    mask = [any(a <= st < b or (st < b and en > a) for a, b in spans) for st, en in offsets]
    return ids, mask


def tokenize_messages(tokenizer, messages, fmt: str) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation in format ``fmt`` (resolved) and its assistant-only loss mask."""
    if fmt == "chatml":
        return _chatml(tokenizer, messages)
    if fmt == "template":
        return _template(tokenizer, messages)
    if fmt == "none":
        return _none(tokenizer, messages)
    raise ValueError(f"unresolved chat format {fmt!r}")


def tokenize_text(tokenizer, text: str) -> tuple[list[int], list[bool]]:
    """A plain-text document for continual pretraining: its tokens (with the tokenizer's own BOS, if
    it adds one) and EOS; every token in the loss but the first."""
    ids = list(tokenizer.encode(text, add_special_tokens=True))
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.append(eos)
    return ids, [False] + [True] * (len(ids) - 1)
