"""Reward functions that misbehave, for RewardPool tests. Referenced by import
path from worker processes (the test puts this directory on sys.path)."""

from __future__ import annotations

import os
import subprocess
import time


def sleep_forever(completion: str, answer: str, *, child_pid_file: str | None = None) -> float:
    if child_pid_file:
        # A child of the reward (think: a sandboxed program under test) must
        # die with the worker.
        child = subprocess.Popen(["sleep", "1000"])
        with open(child_pid_file, "w") as fh:
            fh.write(str(child.pid))
    while True:
        time.sleep(1.0)


def raise_value_error(completion: str, answer: str) -> float:
    raise ValueError(f"cannot grade {completion!r}")


def crash(completion: str, answer: str) -> float:
    os._exit(7)


def not_a_number(completion: str, answer: str) -> object:
    return {"score": 1}


def length_ratio(completion: str, answer: str, *, scale: float = 1.0) -> float:
    return scale * len(completion) / max(1, len(answer))


def worker_pid(completion: str, answer: str) -> float:
    return float(os.getpid())
