"""Perplexity of a user's own text (``thinpipe eval --perplexity FILE``, docs/eval.md).

Each row of a JSONL file ``{"text": ...}`` is tokenized as given (no special tokens) and scored as a
document of its own: the summed next-token negative log-likelihood of its tokens 2..n given the ones
before, in nats. Rows are batched right-padded, each row one packed document (segment 0) and its pads
segment -1 with labels -100, so a row sees only itself and the pads score nothing: the batch's sum is
the sum of the rows' own sums. The scoring function is the mesh's held-out pass (``SimMesh.eval_loss``:
the stages, and a run's boundaries where they are part of its model), never the unsplit model, so the
number is what the split model computes; it is also how a model family's loss is checked against
transformers (greedy decoding cannot see a soft-cap or a logit scale).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from thinpipe.config import ConfigError

ScoreFn = Callable[[dict], tuple[float, int]]  # a packed batch -> (summed token NLL, scored tokens)


def read_texts(path: str | Path) -> list[str]:
    """The ``text`` of every non-blank line of a JSONL file, or one ConfigError line naming the bad line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--perplexity {path}: no such file; give a JSONL file with one {{\"text\": ...}} per line")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--perplexity {path} cannot be read as UTF-8 text ({type(e).__name__})") from None
    texts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ConfigError(f"--perplexity {path}, line {n}: not a JSON object") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"]:
            raise ConfigError(f"--perplexity {path}, line {n}: each line is an object with a non-empty \"text\" "
                              "string")
        texts.append(row["text"])
    if not texts:
        raise ConfigError(f"--perplexity {path} holds no row: give one {{\"text\": ...}} per line")
    return texts


def row_batch(rows: list[list[int]], pad_id: int = 0) -> dict:
    """Rows of token ids as one right-padded batch: each row its own document, its pads scoring nothing."""
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    seg = torch.full((len(rows), t), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        seg[i, :len(r)] = 0
    labels = ids.masked_fill(seg < 0, -100)
    return {"input_ids": ids, "labels": labels, "segment_ids": seg}


def perplexity(score: ScoreFn, tokenizer, texts: list[str], batch_size: int = 8,
               progress: Callable[[int], None] | None = None) -> dict:
    """``nll_sum`` (nats), ``tokens`` (scored), ``rows``, ``nll_per_token`` and ``perplexity`` of ``texts``
    scored by ``score`` (the last two None when no row has a second token); rows sorted by length into
    batches of ``batch_size`` (the sums do not depend on it)."""
    rows = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise ConfigError(f"--perplexity: row {empty[0] + 1} encodes to no tokens: give it some text")
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    nll, tokens = 0.0, 0
    for start in range(0, len(order), batch_size):
        part = [rows[i] for i in order[start:start + batch_size]]
        s, n = score(row_batch(part))
        nll, tokens = nll + s, tokens + n
        if progress:
            progress(len(part))
    per_token = nll / tokens if tokens else None  # every row one token long: nothing to score
    return {"nll_sum": nll, "tokens": tokens, "rows": len(rows), "nll_per_token": per_token,
            "perplexity": None if per_token is None else math.exp(per_token)}
