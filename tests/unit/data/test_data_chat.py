"""ByteTokenizer round trips and the assistant-only loss mask of tokenize_chat (paper App. I.3)."""

import pytest

from thinpipe.data import ByteTokenizer, prompt_text, response_text, tokenize_chat


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "<|im_start|>user\nÅngström: 3·10⁻¹⁰ m<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.eos_token_id in ids and ids.count(tok.eos_token_id) == 1
    assert all(0 <= i < 256 for i in ids if i not in (tok.bos_token_id, tok.eos_token_id))
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nÅngström: 3·10⁻¹⁰ m\n"
    assert tok.encode("abc", add_special_tokens=True) == [97, 98, 99]  # no BOS, like SmolLM2
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    assert max(tok.encode(text)) < tok.vocab_size == 512


def test_byte_tokenizer_decodes_anything_a_model_may_emit():
    tok = ByteTokenizer()
    assert tok.decode([0xC3]) == "\ufffd"  # a lone UTF-8 lead byte
    assert tok.decode([300]) == "\ufffd"  # reserved id
    with pytest.raises(ValueError):
        tok.decode([512])


@pytest.mark.parametrize("prompt,response", [
    ("What is 2+2?", "4"),
    ("Solve $x^2=4$.", "We have $x=\\pm 2$, so the answer is $\\boxed{\\pm 2}$."),
    ("", "empty prompt"),
    ("multi\nline\n\nprompt", "multi\nline\n\nresponse with <|im_start|> inside"),
])
def test_loss_mask_covers_exactly_the_response(prompt, response):
    tok = ByteTokenizer()
    ids, mask = tokenize_chat(tok, prompt, response)
    assert len(ids) == len(mask)
    labelled = [i for i, m in zip(ids, mask) if m]
    unlabelled = [i for i, m in zip(ids, mask) if not m]
    assert tok.decode(labelled) == response + "<|im_end|>\n" == response_text(response)
    assert tok.decode(unlabelled) == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(unlabelled) == prompt_text(prompt)
    # the mask is one contiguous run at the end: prompt first, then response
    first = mask.index(True)
    assert not any(mask[:first]) and all(mask[first:])
