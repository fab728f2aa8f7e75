"""``eval.tasks`` during training (objective/task_scores.py): the columns, their cadence, and the numbers
``thinpipe eval --tasks`` gives for the same model. (Sim == dist: tests/integration/test_dist.py.)"""

import contextlib
import io
import json

import pytest

from thinpipe.cli import main
from thinpipe.data import ByteTokenizer
from thinpipe.eval.tasks import MCItem
from thinpipe.objective.task_scores import request_rows

TINY = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "mesh.pp=2",
        "--set", "train.steps=2", "--set", "train.batch_size=2", "--set", "train.seq_len=32",
        "--set", "data.val_rows=4", "--set", "train.lr=1e-3", "--quiet"]


@pytest.mark.slow  # ~7 s: a run and an evaluation of it
def test_tasks_are_scored_with_the_held_out_measure_and_equal_thinpipe_eval_of_the_run(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *TINY, "--set", "eval.every=1", "--set", 'eval.tasks=["arc_easy","piqa"]',
                 "--set", "eval.limit=4"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    cols = {"val_acc_arc_easy", "val_acc_norm_arc_easy", "val_acc_piqa", "val_acc_norm_piqa"}
    # the rows that carry the held-out loss (every step but the last, whose measure is the summary's) carry the
    # tasks too
    assert [r["step"] for r in rows if "val_loss" in r] == [0]
    assert all(cols <= r.keys() for r in rows if "val_loss" in r)
    assert not any(cols & r.keys() for r in rows if "val_loss" not in r)
    summary = json.loads((run / "summary.json").read_text())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["eval", "--run", str(run), "--tasks", "arc_easy,piqa", "--limit", "4", "--json"]) == 0
    for r in json.loads(out.getvalue()):
        assert summary[f"final_val_acc_{r['task']}"] == r["acc"]
        assert summary[f"final_val_acc_norm_{r['task']}"] == r["acc_norm"]


def test_a_request_too_long_keeps_its_choice_and_the_end_of_its_context():
    """lm-eval's model input: the last max_len + 1 tokens of context + choice."""
    item = MCItem(id="x", contexts=["abcdefgh"], continuations=[" yz"], gold=0)
    (ctx, cont), = request_rows(ByteTokenizer(), [item], max_len=5)
    assert len(ctx) + len(cont) == 6 and bytes(cont).endswith(b"yz")
    assert bytes(ctx) == b"abcdefgh"[-(6 - len(cont)):]
    (ctx, cont), = request_rows(ByteTokenizer(), [item], max_len=50)
    assert bytes(ctx) + bytes(cont) == b"abcdefgh yz"


def test_each_rows_log_likelihood_is_what_thinpipe_eval_scores():
    """Row by row (not only the accuracy they add up to): the training-time scorer's summed choice
    log-likelihoods equal eval/loglik's over the same mesh's logits."""
    from tests.helpers import config
    from thinpipe.engine.sim_engine import SimEngine
    from thinpipe.eval.multiple_choice import score_items

    engine = SimEngine(config(model__name="tiny-llama", data__name="synthetic", mesh__pp=2, train__batch_size=3,
                              eval__tasks=["arc_easy"], eval__limit=3))
    scores = engine.objective.scores
    got = scores.loglik(scores.rows["arc_easy"])
    want = score_items(lambda ids, mask: engine.mesh.logits(ids, mask), ByteTokenizer(), scores.items["arc_easy"],
                       progress=False)
    assert len(got) == sum(len(x) for x in want) > 3
    assert got == pytest.approx([ll for item in want for ll in item], rel=1e-5, abs=1e-4)
