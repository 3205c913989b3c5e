"""Held-out evaluation: greedy answers through the inference engine, scored by the reward."""

from __future__ import annotations

import asyncio
from typing import Any

from areal_kernel.api.engine import InferenceEngine

# What a reward that declares no success_threshold counts as solved: full
# marks on the 0/1 scale that the built-in rewards use (defined with the reward contract).
from areal_kernel.api.reward import DEFAULT_SUCCESS_THRESHOLD
from areal_kernel.api.workflow import WorkflowProtocol
from areal_kernel.utils import aio


async def _aevaluate(
    workflow: WorkflowProtocol, engine: InferenceEngine, records: list[dict], max_new_tokens: int, concurrency: int
) -> list[tuple[float, str]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(rec: dict) -> tuple[float, str]:
        async with sem:
            return await workflow.aevaluate(engine, rec, max_new_tokens)

    try:
        return await asyncio.gather(*(one(r) for r in records))
    finally:
        # Sessions are per event loop; this loop ends with this call.
        close = getattr(engine, "aclose", None)
        if close is not None:
            await close(current_loop_only=True)


def evaluate(
    workflow: WorkflowProtocol,
    engine: InferenceEngine,
    records: list[dict],
    max_new_tokens: int,
    concurrency: int = 32,
    success_threshold: float | None = None,
) -> dict[str, Any]:
    """Greedy answers to ``records``, scored by the reward.

    ``eval/reward`` is the mean reward; ``eval/accuracy`` the fraction of
    answers whose reward reaches ``success_threshold`` (the reward's declared
    threshold), so partial credit is not reported as accuracy."""
    if not records:
        return {"eval/accuracy": float("nan"), "eval/reward": float("nan"), "eval/n": 0, "samples": []}
    threshold = DEFAULT_SUCCESS_THRESHOLD if success_threshold is None else success_threshold
    # A loop that ends clean: what an agent leaves on it is closed before it closes (utils.aio).
    results = aio.run(_aevaluate(workflow, engine, records, max_new_tokens, concurrency), "evaluation")
    scores = [s for s, _ in results]
    return {
        "eval/accuracy": sum(s >= threshold for s in scores) / len(scores),
        "eval/reward": sum(scores) / len(scores),
        "eval/n": len(scores),
        "samples": [(r.get("prompt"), r.get("answer"), text, s) for r, (s, text) in zip(records, results)],
    }
