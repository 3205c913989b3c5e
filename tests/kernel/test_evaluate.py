"""Held-out evaluation keeps mean reward and accuracy apart: a reward with
partial credit must not be reported as accuracy."""
import math

from areal_kernel.trainer.evaluate import evaluate


class ScoreFromRecord:
    """A user workflow whose greedy answer scores what the record says
    (the evaluation's aggregation is under test, not generation)."""

    async def aevaluate(self, engine, record, max_new_tokens):
        return record["score"], f"answer {record['id']}"


def test_accuracy_counts_samples_that_reach_the_threshold_and_reward_is_the_mean():
    records = [{"id": i, "score": s} for i, s in enumerate([1.0, 0.5, 0.5, 0.0])]
    out = evaluate(ScoreFromRecord(), object(), records, max_new_tokens=4, success_threshold=1.0)
    assert out["eval/reward"] == 0.5
    assert out["eval/accuracy"] == 0.25  # partial credit is not a solved sample
    assert out["eval/n"] == 4
    lenient = evaluate(ScoreFromRecord(), object(), records, max_new_tokens=4, success_threshold=0.5)
    assert lenient["eval/accuracy"] == 0.75 and lenient["eval/reward"] == 0.5


def test_undeclared_threshold_means_full_marks_and_no_records_is_nan():
    records = [{"id": 0, "score": 0.99}, {"id": 1, "score": 1.0}]
    assert evaluate(ScoreFromRecord(), object(), records, max_new_tokens=4)["eval/accuracy"] == 0.5
    empty = evaluate(ScoreFromRecord(), object(), [], max_new_tokens=4)
    assert empty["eval/n"] == 0 and math.isnan(empty["eval/accuracy"]) and math.isnan(empty["eval/reward"])


class Rendezvous:
    """A workflow whose answers wait until the other job's first answer has
    started: asked one job after the other, the first job never finishes
    (the test's timeout turns that into a failure)."""

    def __init__(self, started: dict, mine: str, other: str) -> None:
        self.started, self.mine, self.other = started, mine, other

    async def aevaluate(self, engine, record, max_new_tokens):
        import asyncio

        self.started.setdefault(self.mine, asyncio.Event()).set()
        await asyncio.wait_for(self.started.setdefault(self.other, asyncio.Event()).wait(), timeout=5)
        engine.append((self.mine, record["id"]))
        return record["score"], self.mine


class Sessions(list):
    """An engine that records answers and counts the closes of its sessions."""

    closes = 0

    async def aclose(self, current_loop_only=False):
        self.closes += 1


def test_jobs_are_asked_at_once_and_summarised_apart():
    from areal_kernel.trainer.evaluate import EvalJob, evaluate_together

    started: dict = {}
    engine = Sessions()
    a = EvalJob(Rendezvous(started, "a", "b"), engine, [{"id": 0, "score": 1.0}, {"id": 1, "score": 0.0}], 4)
    b = EvalJob(Rendezvous(started, "b", "a"), engine, [{"id": 2, "score": 0.5}], 4, success_threshold=0.5)
    empty = EvalJob(ScoreFromRecord(), engine, [], 4)
    ra, rb, re = evaluate_together([a, b, empty])
    assert sorted(engine) == [("a", 0), ("a", 1), ("b", 2)]
    assert (ra["eval/accuracy"], ra["eval/reward"], ra["eval/n"]) == (0.5, 0.5, 2)
    assert (rb["eval/accuracy"], rb["eval/reward"], rb["eval/n"]) == (1.0, 0.5, 1)
    assert [s[2] for s in ra["samples"]] == ["a", "a"] and rb["samples"][0][2] == "b"
    assert re["eval/n"] == 0 and math.isnan(re["eval/accuracy"])
    assert engine.closes == 1  # one shared engine: its sessions closed once
