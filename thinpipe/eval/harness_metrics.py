"""The per-document metrics of thinpipe's built-in harness tasks (``harness_tasks.py``), as lm-eval
``process_results`` functions: ``(doc, [generation]) -> {metric: value}``.

- ROUGE-1 (XSum): ``rouge_score``'s F-measure with its Porter stemmer on white-space-collapsed texts, as
  lm-eval's ``cnn_dailymail`` scores it (``normalize_text`` there), of the generation's first non-empty line.
- Token F1 (NarrativeQA): the SQuAD v1.1 evaluation script's F1 (lower case, punctuation and articles
  a / an / the removed, white space collapsed; the harmonic mean of token precision and recall over the
  common token multiset), the best over the references: what SCROLLS reports for NarrativeQA.
"""

from __future__ import annotations

import re
import string
from collections import Counter


def normalize_answer(s: str) -> str:
    """SQuAD v1.1's normalisation."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def narrativeqa_results(doc: dict, results: list[str]) -> dict:
    return {"f1": max(token_f1(results[0], ref) for ref in doc["answer"])}


def xsum_results(doc: dict, results: list[str]) -> dict:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    first = next((line for line in results[0].splitlines() if line.strip()), "")  # XSum: a one-sentence summary
    reference, summary = (re.sub(r"\s+", " ", t).strip() for t in (doc["summary"], first))
    return {"rouge1": scorer.score(reference, summary)["rouge1"].fmeasure}
