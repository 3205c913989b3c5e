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
