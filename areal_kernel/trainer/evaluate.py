"""Held-out evaluation: greedy answers through the inference engine, scored by the reward."""
from __future__ import annotations

import asyncio
from typing import Any


async def _aevaluate(workflow: Any, engine: Any, records: list[dict], max_new_tokens: int, concurrency: int) -> list[tuple[float, str]]:
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


def evaluate(workflow: Any, engine: Any, records: list[dict], max_new_tokens: int, concurrency: int = 32) -> dict[str, Any]:
    """Mean greedy reward (accuracy for 0/1 rewards) on ``records``."""
    if not records:
        return {"eval/accuracy": float("nan"), "eval/n": 0, "samples": []}
    results = asyncio.run(_aevaluate(workflow, engine, records, max_new_tokens, concurrency))
    scores = [s for s, _ in results]
    return {
        "eval/accuracy": sum(scores) / len(scores),
        "eval/n": len(scores),
        "samples": [(r.get("prompt"), r.get("answer"), text, s) for r, (s, text) in zip(records, results)],
    }
