"""lm-evaluation-harness through thinpipe's stages (``thinpipe eval --harness``, issue 39): the same tasks give
the same numbers through lm-eval's own ``hf`` backend and through the mesh (one stage or split in two), and the
built-in offline tasks (MedMCQA, XSum ROUGE-1, NarrativeQA F1) run here."""

import json
from pathlib import Path

import pytest

from tests.chat_families import model_folder
from thinpipe.cli import main
from thinpipe.config import ConfigError
from thinpipe.eval.harness_metrics import narrativeqa_results, token_f1, xsum_results

WORDS = ["fox", "dog", "cat", "two", "four", "what", "is", "the", "quick", "brown", "lazy", "solve", "hello"]
TASKS = ["tiny_mc", "tiny_gen", "tiny_ppl"]  # log-likelihood, generation, rolling log-likelihood


def _task(name: str, rows: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(rows))}\n"
            f"test_split: test\n{body}")


@pytest.fixture(scope="module")
def harness_setup(tmp_path_factory):
    """A tiny Qwen2 folder (its own BPE tokenizer) and three task YAMLs on 12 local rows, one per request type."""
    import random

    root = tmp_path_factory.mktemp("harness")
    rng = random.Random(0)
    rows = []
    for i in range(12):
        choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in range(3)]
        rows.append({"question": " ".join(rng.choice(WORDS) for _ in range(5)), "choices": choices, "label": i % 3,
                     "text": " ".join(rng.choice(WORDS) for _ in range(40)), "answer": choices[0]})
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(_task("tiny_mc", data, (
        'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")))
    (tasks / "tiny_gen.yaml").write_text(_task("tiny_gen", data, (
        'output_type: generate_until\ndoc_to_text: "{{text}}\\nQuestion: {{question}}\\nAnswer:"\n'
        'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")))
    (tasks / "tiny_ppl.yaml").write_text(_task("tiny_ppl", data, (
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
        "  - metric: word_perplexity\n  - metric: bits_per_byte\n")))
    return model_folder("qwen2", root / "qwen"), tasks


def _hf(folder, tasks, include, **kw):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32", device="cpu", batch_size=4,
                           tasks=tasks, task_manager=TaskManager(include_path=[str(include)]), random_seed=0,
                           numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, **kw)


@pytest.mark.slow
def test_harness_through_the_mesh_equals_lm_evals_hf_backend(harness_setup, capsys):
    """The CLI on a model split in 2 stages prints one JSON object whose results are lm-eval's `hf` backend's on the
    same folder, metric for metric; per request, the generations are equal too, and the log-likelihoods to float
    rounding (the mesh attends per packed document, models/packed_attention.py; transformers through a mask)."""
    from lm_eval import simple_evaluate

    from thinpipe.commands.evaluate import _eval_model
    from thinpipe.eval.harness import MeshLM

    folder, tasks = harness_setup
    hf = _hf(folder, TASKS, tasks, log_samples=True)
    assert main(["eval", "--model", str(folder), "--harness", ",".join(TASKS), "--harness-include", str(tasks),
                 "--set", "mesh.pp=2", "--batch-size", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # exactly one JSON object on stdout
    assert out["pp"] == 2
    for task in TASKS:
        ours, theirs = out["results"][task], hf["results"][task]
        keys = [k for k in theirs if "," in k]
        assert keys and {k: ours[k] for k in keys} == {k: theirs[k] for k in keys}, task
    assert set(hf["results"]["tiny_mc"]) >= {"acc,none", "acc_norm,none"}

    logits_fn, tok, gen, _, config = _eval_model(str(folder), "cpu", ["mesh.pp=2"], need_mesh=True)
    from lm_eval.tasks import TaskManager

    mine = simple_evaluate(model=MeshLM(logits_fn, tok, gen.ids, config, batch_size=4), tasks=TASKS,
                           task_manager=TaskManager(include_path=[str(tasks)]), log_samples=True, random_seed=0,
                           numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    def flat(resps):  # every response's leaves: log-likelihoods (float), is-greedy flags, generations
        return [x for r in resps for x in (flat(r) if isinstance(r, (list, tuple)) else [r])]

    for task in TASKS:
        got, want = (flat([s["resps"] for s in out_["samples"][task]]) for out_ in (mine, hf))
        assert len(got) == len(want) and all(type(a) is type(b) for a, b in zip(got, want)), task
        assert [g for g in got if not isinstance(g, float)] == [w for w in want if not isinstance(w, float)], task
        assert [g for g in got if isinstance(g, float)] == pytest.approx(
            [w for w in want if isinstance(w, float)], rel=1e-6, abs=1e-5), task
    gens = [s["resps"][0][0] for s in mine["samples"]["tiny_gen"]]
    assert all(gens) and len(set(gens)) > 1  # real, differing generations were compared


@pytest.mark.slow
def test_builtin_offline_tasks_run_and_medmcqa_is_lm_evals_task(harness_setup, tmp_path, capsys, monkeypatch):
    """thinpipe_medmcqa / _xsum / _narrativeqa run offline with their metrics; thinpipe_medmcqa through the mesh
    equals lm-eval's own medmcqa task (its YAML, dataset replaced by the same local rows) through `hf`. IFEval
    without nltk's punkt_tab is refused in one line before any model runs."""
    import lm_eval
    import nltk

    with monkeypatch.context() as m:
        m.setattr(nltk.data, "path", [str(tmp_path)])
        assert main(["eval", "--model", "tiny-llama", "--harness", "ifeval"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "punkt_tab" in err[0] and "NLTK_DATA" in err[0], err

    from thinpipe.data.fetch import cache_dir

    folder, _ = harness_setup
    assert main(["eval", "--model", str(folder), "--harness", "thinpipe_medmcqa,thinpipe_xsum,thinpipe_narrativeqa",
                 "--limit", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {t: out["n-samples"][t]["original"] for t in out["n-samples"]} == {
        "thinpipe_medmcqa": 4183, "thinpipe_xsum": 1000, "thinpipe_narrativeqa": 3000}
    assert "acc,none" in out["results"]["thinpipe_medmcqa"]
    assert 0 <= out["results"]["thinpipe_xsum"]["rouge1,none"] <= 1
    assert 0 <= out["results"]["thinpipe_narrativeqa"]["f1,none"] <= 1

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    rows = cache_dir() / "harness" / "data" / "thinpipe_medmcqa.jsonl"
    original = Path(lm_eval.__file__).parent / "tasks" / "medmcqa" / "medmcqa.yaml"
    (theirs / "medmcqa_here.yaml").write_text(
        f"include: {json.dumps(str(original))}\n" + _task("medmcqa_here", rows, "training_split: null\n"
                                                          "validation_split: null\n"))
    hf = _hf(folder, ["medmcqa_here"], theirs, limit=20)
    assert main(["eval", "--model", str(folder), "--harness", "thinpipe_medmcqa", "--limit", "20", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)["results"]["thinpipe_medmcqa"]
    assert ours["acc,none"] == hf["results"]["medmcqa_here"]["acc,none"]
    assert ours["acc_norm,none"] == hf["results"]["medmcqa_here"]["acc_norm,none"]


def test_harness_inputs_are_checked_in_one_line(tmp_path, capsys):
    for argv, words in [(["--harness-include", str(tmp_path)], "give --harness TASKS too"),
                        (["--harness", "x", "--harness-include", str(tmp_path / "nope")], "not a folder"),
                        (["--harness", " , "], "--harness is empty"),
                        (["--tasks", "arc_easy", "--num-fewshot", "2"], "applies to --harness"),
                        (["--run", str(tmp_path), "--model", "tiny-llama", "--harness", "x"], "not both")]:
        assert main(["eval", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], (argv, err)


def test_sampled_generation_is_refused():
    from types import SimpleNamespace

    from thinpipe.eval.harness import MeshLM

    class Tok:
        eos_token_id, bos_token_id = 0, None

        def decode(self, ids, **kw):
            return "<eos>"

    lm = MeshLM(None, Tok(), None, max_length=64)
    req = SimpleNamespace(args=("hi", {"do_sample": True, "temperature": 0.7}), task_name="sampled")
    with pytest.raises(ConfigError, match="decodes greedily"):
        lm.generate_until([req], disable_tqdm=True)


def test_token_f1_and_rouge1_hand_computed():
    # "The cat sat." vs "a cat sat down": normalised "cat sat" / "cat sat down": P = 1, R = 2/3, F1 = 0.8
    assert token_f1("The cat sat.", "a cat sat down") == pytest.approx(0.8)
    assert token_f1("dog", "cat") == 0.0
    assert narrativeqa_results({"answer": ["nothing here", "a cat sat down"]}, ["The cat sat."]) == {
        "f1": pytest.approx(0.8)}
    # ROUGE-1 F on stemmed unigrams: "cats are running" vs "the cat runs": stems cat, are, run / the, cat, run:
    # 2 of 3 both ways: F = 2/3 (the generation's first non-empty line is the summary)
    assert xsum_results({"summary": "the cat runs"}, ["\ncats are  running\nmore"])["rouge1"] == pytest.approx(2 / 3)


IFEVAL_CHECK = """
import json, sys
from lm_eval.tasks.ifeval import utils
def doc(ids, kwargs):
    return {"key": 0, "instruction_id_list": ids, "kwargs": kwargs, "prompt": "p"}
cases = [(doc(["punctuation:no_comma"], [{}]), "hi there"), (doc(["punctuation:no_comma"], [{}]), "hi, there"),
         (doc(["length_constraints:number_words"], [{"relation": "less than", "num_words": 4}]), "one two three"),
         (doc(["length_constraints:number_words"], [{"relation": "less than", "num_words": 4}]), "one two three four"),
         (doc(["language:response_language"], [{"language": "en"}]), "This is plainly a sentence written in English."),
         (doc(["language:response_language"], [{"language": "en"}]), "Ceci est une phrase entierement en francais.")]
print(json.dumps([utils.process_results(d, [r])["prompt_level_strict_acc"] for d, r in cases]))
"""


def test_lm_evals_ifeval_task_scores_with_the_pinned_dependencies(tmp_path):
    """``--harness ifeval`` runs lm-eval's own task: its module imports (langdetect, immutabledict, nltk: brought
    by requirements.txt and the ``harness`` extra) and its checkers score, given nltk's ``punkt_tab`` (here a
    parameter-less stand-in in the format nltk reads: sentence splitting needs no learned abbreviations for
    these answers) and a local copy of its rows (docs/eval.md). A fresh process: lm-eval looks for punkt_tab
    while importing the task."""
    import os
    import subprocess
    import sys

    english = tmp_path / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (english / name).write_text("")
    out = subprocess.run([sys.executable, "-c", IFEVAL_CHECK], env={**os.environ, "NLTK_DATA": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Error loading" not in out.stdout + out.stderr  # found locally: no download tried
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False, True, False, True, False]

