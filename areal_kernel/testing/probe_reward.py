"""A real reward function that records how it was called, for the workflow
contract (``WorkflowContract``): it runs in the kernel's reward worker
processes like any reward, and appends one JSON line per call to
``log_path`` (a setting, so it crosses into the worker as the settings of
any reward do). With ``fail`` set it raises after recording, which the
workflow must count as a failed reward call.

Kept apart from the contract suites so that a reward worker importing it
imports neither pytest nor torch.
"""

from __future__ import annotations

import json

PROBE_REWARD_TARGET = "areal_kernel.testing.probe_reward:probe_reward"
PROBE_FAILURE = "contract probe reward failed on purpose"


def probe_score(completion: str) -> float:
    """The score ``probe_reward`` gives ``completion``: a value in [0, 1]
    that differs between most completions, so a test can tell which call's
    score a trajectory carries."""
    return (sum(map(ord, completion)) % 89) / 88.0


def probe_reward(completion: str, answer: str, *, log_path: str, fail: bool = False) -> float:
    """Record ``completion``, ``answer`` (with their types) and ``fail``, then
    return ``probe_score(completion)`` or, with ``fail``, raise."""
    row = {
        "completion": completion,
        "answer": answer,
        "completion_type": type(completion).__name__,
        "answer_type": type(answer).__name__,
        "score": probe_score(completion) if isinstance(completion, str) else None,
    }
    with open(log_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    if fail:
        raise RuntimeError(PROBE_FAILURE)
    return probe_score(completion)


def read_probe_calls(log_path: str) -> list[dict]:
    """Every call ``probe_reward`` recorded in ``log_path`` (none: ``[]``)."""
    try:
        with open(log_path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
