"""The headline ratio of each benchmark, collected for ``make bench``'s table.

A benchmark calls ``report(...)`` once per ratio it measures. Run alone, it
only prints the line; under ``bench/run_all.py`` (which sets
``AREAL_BENCH_SUMMARY``) the line is also appended, as JSON, to that file, and
the runner ends with one table of every ratio, its goal and the command that
produced it.
"""
from __future__ import annotations

import json
import os
import shlex
import sys

SUMMARY_ENV = "AREAL_BENCH_SUMMARY"


def command() -> str:
    """How this benchmark was invoked, as a command to paste."""
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "?"
    return " ".join(["OMP_NUM_THREADS=1", ".venv/bin/python", shlex.quote(script), *map(shlex.quote, sys.argv[1:])])


def report(
    what: str, value: float, goal: float | None = None, *, higher_is_better: bool = True, unreliable: str | None = None
) -> None:
    """One ratio: ``what`` (e.g. "async / sync samples/s"), its value, and the
    goal it should meet (None: measured for information, no goal).
    ``unreliable``: why this measurement cannot judge the goal (the bench
    saw the machine change speed between the runs it compares); the goal
    is then reported as not judged rather than met or not."""
    met = None if goal is None or unreliable else (value >= goal if higher_is_better else value <= goal)
    if goal is None:
        goal_text = ""
    elif unreliable:
        goal_text = f" (goal {'>=' if higher_is_better else '<='} {goal:g}: not judged, {unreliable})"
    else:
        goal_text = f" (goal {'>=' if higher_is_better else '<='} {goal:g}: {'met' if met else 'NOT met'})"
    print(f"ratio: {what} = {value:.3f}{goal_text}", flush=True)
    path = os.environ.get(SUMMARY_ENV)
    if path:
        row = {"what": what, "value": value, "goal": goal, "higher_is_better": higher_is_better, "met": met,
               "command": command(), "unreliable": unreliable}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def table(rows: list[dict]) -> str:
    """The rows as one markdown table."""
    out = ["| ratio | value | goal | met | command |", "|---|---|---|---|---|"]
    for r in rows:
        goal = "—" if r["goal"] is None else f"{'>=' if r['higher_is_better'] else '<='} {r['goal']:g}"
        met = "—" if r["met"] is None else ("yes" if r["met"] else "**no**")
        if r.get("unreliable"):
            met = f"not judged ({r['unreliable']})"
        out.append(f"| {r['what']} | {r['value']:.3f} | {goal} | {met} | `{r['command']}` |")
    return "\n".join(out)
