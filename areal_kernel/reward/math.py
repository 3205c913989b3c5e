"""Math reward through ``math-verify`` (symbolic equivalence via sympy).

``math_verify`` normally enforces its own timeouts with signals, which only
work in the main thread; we disable them and run rewards under
``RewardPool``, which kills a worker that runs too long.
"""

from __future__ import annotations

from typing import Any


def _quiet() -> None:
    """Mark math-verify's "timeout disabled" warning as shown: disabling is deliberate."""
    import math_verify.grader as grader
    import math_verify.parser as parser

    parser.TIMEOUT_WARNING_SHOWN = True
    grader.TIMEOUT_WARNING_SHOWN = True


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    return parse(text, parsing_timeout=None)


def _is_plain_number(value: Any) -> bool:
    import sympy

    return isinstance(value, sympy.Number)


def math_verify_reward(completion: str, answer: str, *, numeric_needs_number: bool = True) -> float:
    """1.0 if ``completion`` states a result equivalent to ``answer``, else 0.0.

    ``"8"``, ``"The answer is 8."``, ``"3 + 5 = 8"`` and ``"\\boxed{8}"`` all
    match ``"8"``. ``numeric_needs_number``: when the gold answer is a plain
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
    pred = _parse(completion)
    if not pred:
        return 0.0
    if numeric_needs_number and _is_plain_number(gold[0]) and not _is_plain_number(pred[0]):
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))


def warmup() -> None:
    """Import math-verify's parsers (about 1 s) before the first timed call."""
    math_verify_reward("\\boxed{1}", "1")
