"""Math reward through ``math-verify`` (symbolic equivalence via sympy).

``math_verify`` normally enforces its own timeouts with signals, which only
work in the main thread; we disable them and run rewards under
``RewardPool``, which kills a worker that runs too long.
"""

from __future__ import annotations

import re
from typing import Any


def _quiet() -> None:
    """Mark math-verify's "timeout disabled" warning as shown: disabling is deliberate."""
    import math_verify.grader as grader
    import math_verify.parser as parser

    parser.TIMEOUT_WARNING_SHOWN = True
    grader.TIMEOUT_WARNING_SHOWN = True


# Words and signs after which a completion states its result ("3 + 4 = 7",
# "The answer is 7", "The answer would be 7", "Answer: 7", "3 plus 4 equals 7").
# An adverb may sit between the word and the result ("3 + 1 is actually 4").
_MARKER = re.compile(
    r"(?:=|:|\b(?:is|are|be|equals|equal to|gives|makes|get|gets)\b)"
    r"(?:\s+(?:actually|simply|just|exactly|clearly|then|therefore|now)\b)?",
    re.IGNORECASE,
)
# The end of a clause: a newline, the end of the text, or sentence/clause
# punctuation followed by a space or the end ("8.5" does not end at its dot).
_CLAUSE_END = re.compile(r"\n|[.!?,;:](?=\s|$)|$")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")
_WRAPPED = re.compile(r"^(?:\$\$?(.+?)\$\$?|\\\((.+?)\\\)|\\\[(.+?)\\\])$", re.DOTALL)


def _math_span(span: str) -> str | None:
    """``span`` (markdown emphasis, spaces and a closing period stripped) if it
    is math alone — a number or expression, bare or in ``$...$`` /
    ``\\(...\\)`` / ``\\[...\\]`` — and not prose; else ``None``."""
    s = span.strip().strip("*_\"'").strip()
    s = s.rstrip(".!").strip().strip("*_\"'").strip()
    if not s:
        return None
    m = _WRAPPED.match(s)
    if m:
        return s  # delimited math: anything inside is math
    if _WORD.search(_LATEX_COMMAND.sub("", s)):
        return None  # a word: prose, not an answer
    if not any(c.isdigit() for c in s) and "\\" not in s:
        return None
    return s


def final_answer(completion: str) -> str | None:
    """The completion's final answer, or ``None`` when it states none.

    1. The last ``\\boxed{...}``, if there is one (the whole text is
       returned: math-verify reads the boxed answer first).
    2. Else the last explicit result: the math that follows a marker
       (``=``, ``:``, ``is``, ``are``, ``be``, ``equals``, ``equal to``,
       ``gives``, ``makes``, ``get(s)``, maybe with an adverb such as
       ``actually``) up to the end of its clause, when that is math alone
       (``"3 + 4 = 7"``, ``"The answer is 7."``, ``"Answer: $7$"``).
    3. Else the completion's last line, when it is math alone (``"7"``,
       ``"$7$"``, ``"**7**"``, ``"3+4"``).

    A completion with none of these, e.g. one cut off mid-sentence whose
    only numbers are inside prose (``"To solve this puzzle, you simply add
    3 to the"``), has no final answer: a number that merely appears last is
    not one.
    """
    text = completion.strip()
    if "\\boxed" in text or "\\fbox" in text:
        return text
    answer = None
    for m in _MARKER.finditer(text):
        rest = text[m.end() :]
        end = _CLAUSE_END.search(rest)
        span = _math_span(rest[: end.start()] if end else rest)
        if span is not None:
            answer = span
    if answer is not None:
        return answer
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return _math_span(lines[-1]) if lines else None


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    return parse(text, parsing_timeout=None)


def _is_plain_number(value: Any) -> bool:
    import sympy

    return isinstance(value, sympy.Number)


def math_verify_reward(completion: str, answer: str, *, numeric_needs_number: bool = True) -> float:
    """1.0 if ``completion`` states a result equivalent to ``answer``, else 0.0.

    Only the completion's final answer counts (``final_answer``: a boxed
    answer, else the result after the last ``=`` / ``is`` / ``answer:``...,
    else a last line that is math alone): ``"8"``, ``"The answer is 8."``,
    ``"3 + 5 = 8"`` and ``"\\boxed{8}"`` all match ``"8"``; ``"you simply
    add 8 to the"`` (cut off mid-sentence) does not. ``numeric_needs_number``: when the gold answer is a plain
    number, the completion's answer must be one too. Without it, echoing the
    question (``"3+5"``) verifies as 8, which a policy learns to exploit on
    arithmetic tasks.
    """
    from math_verify import verify

    _quiet()
    gold = _parse(answer)
    if not gold:
        # A gold answer math-verify cannot read: fall back to plain comparison.
        from areal_kernel.reward.exact_match import exact_match_reward

        return exact_match_reward(completion, answer)
    stated = final_answer(completion)
    if stated is None:
        return 0.0
    pred = _parse(stated)
    if not pred:
        return 0.0
    if numeric_needs_number and _is_plain_number(gold[0]) and not _is_plain_number(pred[0]):
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))


def warmup() -> None:
    """Import math-verify's parsers (about 1 s) before the first timed call."""
    math_verify_reward("\\boxed{1}", "1")
