"""Exact-match reward with light normalisation (no sympy, microseconds per call)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number as people write it: sign, thousands separators, decimals.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")


def _normalise(text: str) -> str:
    text = " ".join(text.strip().lower().split())
    return text.rstrip(".!").strip()


def _as_number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", ""))
    except (InvalidOperation, ValueError):
        return None


def last_number(text: str) -> Decimal | None:
    """The last number written in ``text`` (``"The answer is 1,000."`` -> 1000)."""
    found = _NUMBER.findall(text)
    return _as_number(found[-1]) if found else None


def exact_match_reward(completion: str, answer: str, *, strict: bool = False) -> float:
    """1.0 if ``completion`` gives ``answer``, else 0.0.

    ``strict``: the stripped strings must be identical. Otherwise case and
    whitespace are ignored, a trailing period is dropped, a ``\\boxed{...}``
    answer counts, and for a numeric ``answer`` the last number in the
    completion is compared by value (``"8.0"`` matches ``"8"``).
    """
    if strict:
        return float(completion.strip() == answer.strip())
    boxed = _BOXED.findall(completion)
    candidate = boxed[-1] if boxed else completion
    gold_num = _as_number(answer.strip())
    if gold_num is not None:
        got = last_number(candidate)
        return float(got is not None and got == gold_num)
    return float(_normalise(candidate) == _normalise(answer))
