"""Reward scoring shared by the built-in workflows.

Every workflow scores completions the same way: the run's reward in the
kernel's reward pool (worker processes, enforced timeouts), a failed call
scored 0 and counted. The counters are part of the workflow contract: the
trainer reads ``reward_calls``, ``reward_failures`` and
``last_reward_error`` to log failures and to stop a run whose reward keeps
failing.
"""

from __future__ import annotations

from typing import Any

from areal_kernel.logging import get_logger

log = get_logger(__name__)


class RewardScoring:
    """Mixin for workflows that have ``pool`` (the reward pool) and
    ``reward_target`` (the reward's import string)."""

    pool: Any
    reward_target: str
    # Class defaults; the first ``+=`` gives each instance its own counter.
    reward_calls: int = 0
    reward_failures: int = 0
    last_reward_error: str | None = None

    async def score(self, completion: str, answer: Any) -> float:
        """The reward of ``completion`` against ``answer``; 0 when the call failed."""
        result = await self.pool.ascore(self.reward_target, completion, str(answer))
        self.reward_calls += 1
        if not result.ok:
            self.reward_failures += 1
            self.last_reward_error = result.error
            # The first few, then every hundredth: causes without flooding the log.
            if self.reward_failures <= 3 or self.reward_failures % 100 == 0:
                log.warning(
                    "reward call failed; scored 0",
                    reward=self.reward_target,
                    error=result.error,
                    failures=self.reward_failures,
                )
        return float(result.score) if result.ok else 0.0
