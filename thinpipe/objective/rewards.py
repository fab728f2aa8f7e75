"""The verifiable math reward of App. D.3 (a binary correctness indicator) and DAPO's soft overlong punishment.

Correctness uses the maintained ``math-verify`` library (answer extraction from LaTeX / boxed / plain text and
symbolic equivalence) when it is installed, and thinpipe's GSM8K extraction (``The answer is N``, else the last
number; ``thinpipe.eval.generative``) compared numerically otherwise, or when math-verify finds nothing to parse.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

from thinpipe.config import ConfigError
from thinpipe.eval.generative import gsm8k_extract, normalize_number

_PARSE_TIMEOUT_S = 5  # math-verify's defaults: an adversarial completion must not hang a rollout worker
_VERIFY_TIMEOUT_S = 5


@functools.cache
def _math_verify() -> Any | None:
    """The math-verify entry points, or None when it is not installed (imported on first use: it pulls sympy
    and an ANTLR LaTeX parser, ~0.4 s, which a training job that never scores math should not pay)."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError:
        return None
    # Boxed answers first (the usual "final answer" convention), then any LaTeX, then plain expressions.
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse, verify, config


def math_verify_available() -> bool:
    return _math_verify() is not None


def _timeouts() -> tuple[int | None, int | None]:
    # math-verify times out with signal.alarm, which only the main thread may use; elsewhere it must run
    # without (as TRL's accuracy_reward does), or it raises instead of scoring.
    if threading.current_thread() is threading.main_thread():
        return _PARSE_TIMEOUT_S, _VERIFY_TIMEOUT_S
    return None, None


def _mv_parse(text: str, completion: bool) -> list:
    mv = _math_verify()
    if mv is None:
        return []
    parse, _, config = mv
    parse_s, _ = _timeouts()
    try:
        if completion:
            return parse(text, extraction_config=config, parsing_timeout=parse_s)
        # A reference answer is usually bare LaTeX or a number (\sqrt{8}, 2\pi, 1,200), which math-verify reads
        # only inside math delimiters (bare, it skips \sqrt{8} and reads 2\pi as 2).
        if not any(m in text for m in ("$", "\\(", "\\[", "\\boxed")):
            parsed = parse(f"${text}$", parsing_timeout=parse_s)
            if parsed:
                return parsed
        return parse(text, parsing_timeout=parse_s)
    # Model text is arbitrary: a parser error (sympy, ANTLR, a timeout) means "nothing parsed", never a crash of
    # the training step; the GSM8K path then decides.
    except Exception:
        return []


def extract_answer(completion: str) -> str | None:
    """The final answer a completion states: math-verify's extracted string when it parses one, else the GSM8K
    rule (``The answer is N``, else the last number, without ``,`` ``$`` or a trailing ``.``); None if none."""
    parsed = _mv_parse(completion, completion=True)
    if parsed:
        return str(parsed[-1])
    return gsm8k_extract(completion)


def _as_number(s: str) -> float | None:
    try:
        value = float(normalize_number(s))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _numeric_equal(got: str | None, answer: str) -> bool:
    if got is None:
        return False
    a, b = _as_number(got), _as_number(answer)
    if a is not None and b is not None:
        return a == b  # "12" == "12.0", "1,200" == "1200"
    return normalize_number(got) == normalize_number(answer)


def math_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals ``answer``, else 0.0 (App. D.3's binary reward).

    With math-verify: its extraction from the completion and ``verify`` (symbolic / numeric equivalence, so
    ``\\frac{1}{2}`` == ``0.5``) decide whenever both sides parse. Otherwise the GSM8K extraction is compared with
    ``answer`` as numbers (exact float equality after removing ``,`` and ``$``), else as normalized strings."""
    mv = _math_verify()
    if mv is not None:
        gold, pred = _mv_parse(answer, completion=False), _mv_parse(completion, completion=True)
        if gold and pred:
            _, verify, _ = mv
            _, verify_s = _timeouts()
            try:
                return 1.0 if verify(gold, pred, timeout_seconds=verify_s) else 0.0
            except Exception:  # as in _mv_parse: a grader error is a wrong answer, not a crash
                return 0.0
    return 1.0 if _numeric_equal(gsm8k_extract(completion), answer) else 0.0


def overlong_penalty(response_len: int, max_response_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476 §3.4, eq. (13)), scaled by ``penalty``:
    0 for ``len <= max - buffer``; ``(max - buffer - len) / buffer * penalty`` for ``max - buffer < len <= max``
    (linear from 0 down to ``-penalty``); ``-penalty`` beyond ``max``. ``buffer == 0`` turns it off (always 0),
    as the DAPO reward manager's overlong_buffer.enable = false. App. D.3: max 7680, buffer 3584, penalty 1.0."""
    if buffer < 0 or penalty < 0:
        raise ConfigError(f"overlong buffer ({buffer}) and penalty ({penalty}) must be >= 0")
    if buffer > max_response_tokens:
        raise ConfigError(f"overlong buffer {buffer} exceeds the maximum response length {max_response_tokens}: "
                          "set the buffer to at most the maximum response length")
    if buffer == 0:
        return 0.0
    expected = max_response_tokens - buffer
    if response_len <= expected:
        return 0.0
    if response_len <= max_response_tokens:
        return (expected - response_len) / buffer * penalty
    return -float(penalty)
