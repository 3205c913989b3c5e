"""Held-out evaluation: greedy answers through the inference engine, scored by the reward."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from areal_kernel.api.engine import InferenceEngine

# What a reward that declares no success_threshold counts as solved: full
# marks on the 0/1 scale that the built-in rewards use (defined with the reward contract).
from areal_kernel.api.reward import DEFAULT_SUCCESS_THRESHOLD
from areal_kernel.api.workflow import WorkflowProtocol
from areal_kernel.utils import aio


@dataclass(frozen=True)
class EvalJob:
    """One held-out set to answer: the workflow that answers (with its policy's
    adapter, if any), the inference engine it asks, the records, the token
    budget and the reward's success threshold (None: full marks)."""

    workflow: WorkflowProtocol
    engine: InferenceEngine
    records: list[dict]
    max_new_tokens: int
    success_threshold: float | None = None


async def _aevaluate(jobs: Sequence[EvalJob], concurrency: int) -> list[list[tuple[float, str]]]:
    # A bound per job: each held-out set keeps the concurrency it has alone,
    # and the sets together reach the servers at once (so they share batches).
    async def answer(job: EvalJob) -> list[tuple[float, str]]:
        sem = asyncio.Semaphore(concurrency)

        async def one(rec: dict) -> tuple[float, str]:
            async with sem:
                return await job.workflow.aevaluate(job.engine, rec, job.max_new_tokens)

        return list(await asyncio.gather(*(one(r) for r in job.records)))

    try:
        return list(await asyncio.gather(*(answer(j) for j in jobs)))
    finally:
        # Sessions are per event loop; this loop ends with this call.
        # Each engine once, however many jobs share it.
        for engine in {id(j.engine): j.engine for j in jobs}.values():
            close = getattr(engine, "aclose", None)
            if close is not None:
                await close(current_loop_only=True)


def _summary(job: EvalJob, results: list[tuple[float, str]]) -> dict[str, Any]:
    if not job.records:
        return {"eval/accuracy": float("nan"), "eval/reward": float("nan"), "eval/n": 0, "samples": []}
    threshold = DEFAULT_SUCCESS_THRESHOLD if job.success_threshold is None else job.success_threshold
    scores = [s for s, _ in results]
    return {
        "eval/accuracy": sum(s >= threshold for s in scores) / len(scores),
        "eval/reward": sum(scores) / len(scores),
        "eval/n": len(scores),
        "samples": [(r.get("prompt"), r.get("answer"), text, s) for r, (s, text) in zip(job.records, results)],
    }


def evaluate_together(jobs: Sequence[EvalJob], concurrency: int = 32) -> list[dict[str, Any]]:
    """Every job's greedy answers, asked at the same time (one event loop):
    servers shared by the jobs batch their requests together instead of
    answering one job's set after another's.
    One summary per job, in order (``evaluate``'s keys)."""
    if not any(j.records for j in jobs):
        return [_summary(j, []) for j in jobs]
    # A loop that ends clean: what an agent leaves on it is closed before it closes (utils.aio).
    results = aio.run(_aevaluate(jobs, concurrency), "evaluation")
    return [_summary(j, r) for j, r in zip(jobs, results)]


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
    job = EvalJob(workflow, engine, list(records), max_new_tokens, success_threshold)
    return evaluate_together([job], concurrency)[0]
