"""The benchmarks' guard against comparing runs on a machine whose speed
changed between them (bench/bench_multi_policy.py: a first run that ran
1.6x slower per training step once made the two single runs look slow and
the wall-time goal look met), and the summary table's "not judged"."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, BENCH)
    try:
        import bench_multi_policy
        import summary

        yield bench_multi_policy, summary
    finally:
        sys.path.remove(BENCH)


def _run(mod, name: str, step_s: list[float]):
    return mod.Run(name=name, steps=[{"train_s": s, "wait_rollout_s": 0.0} for s in step_s])


def test_runs_of_one_speed_compare_and_a_slower_run_is_named(bench_modules):
    mod, _ = bench_modules
    quiet = (_run(mod, "single-add", [4.6, 4.5, 4.4, 4.5]), _run(mod, "single-sub", [4.5, 4.3, 4.6]),
             _run(mod, "multi", [4.4, 4.3, 5.2, 4.3, 4.6]))  # fmt: skip
    assert mod.speed_changed(quiet) is None
    # One slow first step (a warm-up) moves no median.
    assert mod.speed_changed((_run(mod, "a", [9.0, 4.5, 4.5]), _run(mod, "b", [4.5, 4.4, 4.6]))) is None
    slow = (_run(mod, "single-add", [7.2, 7.0, 7.1]), *quiet[1:])
    why = mod.speed_changed(slow)
    assert why is not None and "7.10 s in single-add" in why and "multi" in why and "4.40" in why
    assert mod.speed_changed((_run(mod, "a", [4.5 * mod.SPEED_TOLERANCE]), _run(mod, "b", [4.5]))) is None
    assert mod.speed_changed((_run(mod, "a", [4.5 * mod.SPEED_TOLERANCE + 0.05]), _run(mod, "b", [4.5]))) is not None


def test_an_unreliable_ratio_is_not_judged(bench_modules, tmp_path, monkeypatch, capsys):
    _, summary = bench_modules
    path = str(tmp_path / "summary.jsonl")
    monkeypatch.setenv(summary.SUMMARY_ENV, path)
    summary.report("x / y", 1.6, goal=1.5)
    summary.report("x / y", 1.6, goal=1.5, unreliable="steps 1.6x apart")
    out = capsys.readouterr().out
    assert "(goal >= 1.5: met)" in out and "(goal >= 1.5: not judged, steps 1.6x apart)" in out
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    assert [r["met"] for r in rows] == [True, None] and rows[1]["unreliable"] == "steps 1.6x apart"
    table = summary.table(rows).splitlines()
    assert "| yes |" in table[2] and "not judged (steps 1.6x apart)" in table[3]
