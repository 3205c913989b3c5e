"""Staleness-bounded admission: the arithmetic, kept apart so it can be tested alone.

A rollout may start only while ``started < (max_staleness + version + 1) * batch_size``
where ``started`` counts rollouts admitted and not rejected (running,
waiting in the queue, or already trained on). With ``max_staleness = 0``
rollout and training alternate (synchronous RL); each extra unit lets
generation run one weight version ahead of training.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessBudget:
    batch_size: int
    max_staleness: int
    max_concurrent: int
    started: int = 0  # admitted and not rejected
    running: int = 0

    def capacity(self, version: int) -> int:
        """How many more rollouts may start now."""
        by_staleness = (self.max_staleness + version + 1) * self.batch_size - self.started
        by_concurrency = self.max_concurrent - self.running
        return max(0, min(by_staleness, by_concurrency))

    def admit(self) -> None:
        self.started += 1
        self.running += 1

    def finish(self, kept: bool) -> None:
        self.running -= 1
        if not kept:
            # A rejected rollout frees its slot: it will never be trained on.
            self.started -= 1

    def release(self) -> None:
        """A finished, kept rollout is dropped before training (it became too
        stale while queued behind later rollouts): its slot frees."""
        self.started -= 1
