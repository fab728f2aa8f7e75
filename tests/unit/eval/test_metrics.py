"""acc / acc_norm on a hand-made task whose answers are known in advance."""

import math

import pytest
import torch

from thinpipe.eval import multiple_choice as mc_mod
from thinpipe.eval.multiple_choice import evaluate_mc, item_predictions, mc_metrics, norm_length, score_items
from thinpipe.eval.tasks import MCItem

from ._fakes import CharTokenizer, V, constant_logits_fn

# Every position predicts the same distribution: 'x' and ' x' are likely, all else unlikely.
W = torch.zeros(V)
TOK = CharTokenizer()
W[TOK.encode("x")[0]] = 10.0
W[TOK.encode(" x")[0]] = 10.0
LSE = math.log(2 * math.exp(10.0) + (V - 2))
HI, LO = 10.0 - LSE, 0.0 - LSE  # ~ -0.69 and ~ -10.69

# " xyxy" tokenizes as [' x', 'y', 'x', 'y'] -> 2*HI + 2*LO ~ -22.8 (4 chars -> -5.7 per char)
# " b"    tokenizes as [' b']                -> LO ~ -10.7          (1 char  -> -10.7)
# " x" -> HI ; " by" -> [' b', 'y'] -> 2*LO
ITEMS = [
    # acc picks " b" (0), acc_norm picks " xyxy" (1): acc wrong, acc_norm right
    MCItem("a", ["Q:", "Q:"], [" b", " xyxy"], gold=1),
    # both pick " x": both right
    MCItem("b", ["Q:", "Q:"], [" x", " by"], gold=0),
    # both pick " x": both wrong
    MCItem("c", ["Q:", "Q:"], [" x", " by"], gold=1),
]


def test_fake_scores_are_as_designed():
    lls = score_items(constant_logits_fn(W), TOK, ITEMS, batch_size=2, progress=False)
    expected = [[LO, 2 * HI + 2 * LO], [HI, 2 * LO], [HI, 2 * LO]]
    for got, exp in zip(lls, expected):
        assert got == pytest.approx(exp, abs=1e-4)
    preds = [item_predictions(it, s) for it, s in zip(ITEMS, lls)]
    assert preds == [(0, 1), (0, 0), (0, 0)]


def test_acc_and_acc_norm_disagree_as_designed():
    lls = score_items(constant_logits_fn(W), TOK, ITEMS, progress=False)
    m = mc_metrics(ITEMS, lls)
    assert m["n"] == 3
    assert m["acc"] == pytest.approx(1 / 3)
    assert m["acc_norm"] == pytest.approx(2 / 3)
    # lm-eval's mean_stderr: sample std (ddof=1) / sqrt(n); for [0,1,0] and [1,1,0] both are 1/3
    assert m["acc_stderr"] == pytest.approx(1 / 3)
    assert m["acc_norm_stderr"] == pytest.approx(1 / 3)


def test_evaluate_mc_end_to_end(monkeypatch):
    monkeypatch.setattr(mc_mod, "load_task", lambda name, limit=None: ITEMS[:limit])
    out = evaluate_mc(constant_logits_fn(W), TOK, "handmade", limit=None, batch_size=4)
    assert set(out) == {"task", "n", "acc", "acc_norm", "acc_stderr", "acc_norm_stderr"}
    assert out["task"] == "handmade" and out["n"] == 3
    assert out["acc"] == pytest.approx(1 / 3) and out["acc_norm"] == pytest.approx(2 / 3)
    one = evaluate_mc(constant_logits_fn(W), TOK, "handmade", limit=1)
    assert (one["n"], one["acc"], one["acc_norm"]) == (1, 0.0, 1.0)
    assert math.isnan(one["acc_stderr"])


def test_acc_norm_divides_by_choice_length_without_the_delimiter():
    # lm-eval: completion_len = len(choice), the choice *without* the leading " ".
    item = MCItem("n", ["Q:", "Q:"], [" ab", " abcd"], gold=1)
    assert [norm_length(c) for c in item.continuations] == [2, 4]
    # -3/2 = -1.5 < -5/4 = -1.25 -> choice 1. (Dividing by len(" "+choice) would tie at -1.)
    assert item_predictions(item, [-3.0, -5.0]) == (0, 1)
    # ties go to the lowest index, like np.argmax
    assert item_predictions(MCItem("t", ["", ""], ["a", "b"], gold=0), [-1.0, -1.0]) == (0, 0)


def test_mcitem_validates():
    with pytest.raises(ValueError):
        MCItem("bad", ["a"], ["b", "c"], gold=0)
    with pytest.raises(ValueError):
        MCItem("bad", ["a", "a"], ["b", "c"], gold=2)
