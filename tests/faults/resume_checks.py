"""What a resumed asynchronous run must show, shared by the kill -9 and the
interrupt tests: every step trained once, no sample trained twice, every
batch full and within the staleness bound."""

from __future__ import annotations

import json
import os
from typing import Any

from areal_kernel.testing.recovery import read_samples


def assert_async_run_complete(
    run_dir: str, steps: int, per_step: int, batch: int, staleness: int
) -> list[dict[str, Any]]:
    """Check ``samples.jsonl`` and ``metrics.jsonl`` of a finished run that
    was stopped and resumed; returns its samples for further checks."""
    got = read_samples(run_dir)
    assert [s["step"] for s in got] == list(range(1, steps + 1))
    flat = [u for s in got for u in s["uids"]]
    assert len(flat) == steps * per_step and len(set(flat)) == len(flat)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if "perf/step_s" in line]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["rollout/staleness_max"] <= staleness and r["batch/sequences"] == batch for r in rows)
    return got
