"""Context/continuation split (lm-eval's _encode_pair) and batched scoring vs unbatched."""

import pytest
import torch

from thinpipe.eval.loglik import encode_pair, logits_fn_from_model, score_requests

from ._fakes import CharTokenizer, V

TOK = CharTokenizer()


# ----------------------------------------------------------------------------- splitting


def test_trailing_space_moves_to_continuation():
    a = encode_pair(TOK, "Answer: ", "A")
    b = encode_pair(TOK, "Answer:", " A")
    assert a == b
    ctx, cont = a
    assert ctx == TOK.encode("Answer:")
    assert cont == TOK.encode(" A") and len(cont) == 1  # the ' A' merge survives
    # several trailing whitespace chars move together
    ctx2, cont2 = encode_pair(TOK, "Answer:\n ", "A")
    assert ctx2 == TOK.encode("Answer:") and cont2 == TOK.encode("\n A")


def test_split_is_at_the_context_token_length_of_the_joint_encoding():
    # "hello" -> h e ll o ; "hel" -> h e l (3 tokens).  lm-eval encodes context+continuation
    # together and keeps whole[len(context_enc):], so the continuation is just [o].
    ctx, cont = encode_pair(TOK, "hel", "lo")
    assert ctx == TOK.encode("hel")
    assert TOK.encode("hello") == TOK.encode("he") + TOK.encode("ll") + TOK.encode("o")
    assert cont == TOK.encode("o")


def test_empty_context_and_bos():
    assert encode_pair(TOK, "", "ab") == ([TOK.bos_token_id], TOK.encode("ab"))
    ctx, cont = encode_pair(TOK, "Q:", " ab", add_bos_token=True)
    assert ctx == [TOK.bos_token_id] + TOK.encode("Q:")
    assert cont == TOK.encode(" ab")


# ----------------------------------------------------------------------------- scoring


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg).eval()
    return model


REQUESTS = [
    ("Question: what is red?\nAnswer:", " a tomato"),
    ("Question: what is red?\nAnswer:", " the sky at noon, usually"),
    ("Hi", " there"),
    ("A much longer context that goes on and on about nothing in particular. Then", " it ends."),
    ("Question: pick one\nA. x\nB. y\nAnswer:", " A"),
    ("Question: pick one\nA. x\nB. y\nAnswer:", " B"),
    ("Sarah was better than Maria so Sarah", " got it."),
    ("Sarah was better than Maria so Maria", " got it."),
    ("trailing space ", "moves"),
]


def _direct(model, ctx_ids, cont_ids):
    ids = torch.tensor([ctx_ids + cont_ids])
    with torch.no_grad():
        lp = model(input_ids=ids).logits[0].float().log_softmax(-1)
    n = len(ctx_ids) + len(cont_ids)
    window = lp[n - 1 - len(cont_ids) : n - 1]
    tgt = torch.tensor(cont_ids)
    return float(window.gather(-1, tgt[:, None]).sum()), bool((window.argmax(-1) == tgt).all())


def test_matches_direct_unpadded_computation(tiny_llama):
    fn = logits_fn_from_model(tiny_llama)
    got = score_requests(fn, TOK, REQUESTS, batch_size=4, progress=False)
    for (ctx, cont), (ll, greedy) in zip(REQUESTS, got):
        exp_ll, exp_greedy = _direct(tiny_llama, *encode_pair(TOK, ctx, cont))
        assert ll == pytest.approx(exp_ll, abs=1e-4)
        assert greedy == exp_greedy


def test_batched_equals_unbatched(tiny_llama):
    fn = logits_fn_from_model(tiny_llama)
    one = score_requests(fn, TOK, REQUESTS, batch_size=1, progress=False)
    for bs in (3, 16):
        many = score_requests(fn, TOK, REQUESTS, batch_size=bs, progress=False)
        assert [g for _, g in many] == [g for _, g in one]
        assert [ll for ll, _ in many] == pytest.approx([ll for ll, _ in one], abs=1e-4)


def test_batches_are_right_padded_longest_first_and_deduplicated(tiny_llama):
    seen = []
    base = logits_fn_from_model(tiny_llama)

    def spy(ids, mask):
        seen.append((ids.clone(), mask.clone()))
        return base(ids, mask)

    score_requests(spy, TOK, REQUESTS, batch_size=4, progress=False)
    lengths = []
    for ids, mask in seen:
        for row in mask.tolist():
            n = sum(row)
            assert row == [1] * n + [0] * (len(row) - n)  # right padding
            lengths.append(n)
        assert mask[0].all()  # each batch is as wide as its longest row
    assert lengths == sorted(lengths, reverse=True)
    # the two letter choices share one model input (context only), so one row fewer
    assert len(lengths) == len(REQUESTS) - 1


def test_left_truncation(tiny_llama):
    fn = logits_fn_from_model(tiny_llama)
    ctx, cont = "A long context that will be cut on the left side", " end"
    c_ids, k_ids = encode_pair(TOK, ctx, cont)
    max_len = 10
    full = (c_ids + k_ids)[-(max_len + 1):]
    exp = _direct(tiny_llama, full[: -len(k_ids)], k_ids)
    got = score_requests(fn, TOK, [(ctx, cont)], max_len=max_len, progress=False)[0]
    assert got[0] == pytest.approx(exp[0], abs=1e-4) and got[1] == exp[1]
    with pytest.raises(ValueError):
        score_requests(fn, TOK, [("x", " " + "ab" * 10)], max_len=5, progress=False)


def test_empty_request_list():
    assert score_requests(lambda i, m: None, TOK, [], progress=False) == []
