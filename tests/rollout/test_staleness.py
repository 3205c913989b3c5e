"""Staleness-bounded admission arithmetic."""
from areal_kernel.rollout.staleness import StalenessBudget


def test_synchronous_budget_admits_one_batch_per_version():
    b = StalenessBudget(batch_size=4, max_staleness=0, max_concurrent=100)
    assert b.capacity(version=0) == 4
    for _ in range(4):
        b.admit()
    assert b.capacity(0) == 0
    for _ in range(4):
        b.finish(kept=True)
    assert b.capacity(0) == 0  # accepted but not yet trained on still count
    assert b.capacity(1) == 4  # after the weight update, the next batch may start


def test_staleness_lets_generation_run_ahead():
    b = StalenessBudget(batch_size=4, max_staleness=2, max_concurrent=100)
    assert b.capacity(0) == (2 + 0 + 1) * 4
    for _ in range(12):
        b.admit()
    assert b.capacity(0) == 0 and b.capacity(1) == 4 and b.capacity(3) == 12


def test_rejected_rollouts_free_their_slot():
    b = StalenessBudget(batch_size=2, max_staleness=0, max_concurrent=100)
    b.admit()
    b.admit()
    assert b.capacity(0) == 0
    b.finish(kept=False)
    assert b.capacity(0) == 1


def test_concurrency_cap():
    b = StalenessBudget(batch_size=100, max_staleness=5, max_concurrent=3)
    assert b.capacity(0) == 3
    b.admit()
    b.admit()
    assert b.capacity(0) == 1
    b.finish(kept=True)
    assert b.capacity(0) == 2
