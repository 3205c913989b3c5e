"""Reading a run directory for the report and ``areal inspect``.

The one place that knows the files ``areal train`` writes under ``<run_dir>``:
``metrics.jsonl`` (one JSON object per logged step; a step may be logged in
several lines, e.g. the held-out evaluation after the last step), ``samples.jsonl``
(what each step trained on), ``result.json`` (written only when the run
finished), ``config.yaml``, ``error.log`` (a failed run's traceback) and the
inference servers' ``server-<i>.log``.

Reading never fails on what a run left behind: a directory of a run that is
still going, was killed mid-line, or comes from an older version gives a
:class:`RunData` whose ``notes`` say what is missing or was left out. Only a
path that is not a directory is an error (:class:`RunDirError`).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from areal_kernel.errors import ArealError

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
RESULT_FILE = "result.json"
CONFIG_FILE = "config.yaml"
ERROR_FILE = "error.log"
# The trainer logs a training step's row with its step time; evaluation-only
# rows (before the first step, after the last) lack it.
STEP_KEY = "perf/step_s"
# A server process's log gets this header line each time it is (re)started.
SERVER_START = "=== areal:"


class RunDirError(ArealError):
    """The path given as a run directory is not one (missing, or a file)."""


@dataclass(frozen=True)
class JsonlFile:
    """The readable lines of a JSON-lines file, and the 1-based numbers of
    those that were not (a line cut short by a kill, or not an object)."""

    rows: list[dict[str, Any]]
    bad_lines: list[int]
    last_line_partial: bool


@dataclass(frozen=True)
class ServerLog:
    """One ``server-<i>.log``: how many times that server was started (more
    than once: it was restarted) and its last non-empty line."""

    name: str
    starts: int
    last_line: str


@dataclass
class RunData:
    """What one run directory holds, read leniently (see the module docstring)."""

    path: str
    name: str
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    samples: dict[int, dict[str, Any]] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    config_text: str | None = None
    result: dict[str, Any] | None = None
    error: str | None = None
    servers: list[ServerLog] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        """The trained steps, in order (rows with a step time)."""
        return sorted(s for s, r in self.rows.items() if STEP_KEY in r)

    @property
    def status(self) -> str:
        if self.result is not None:
            return "finished"
        if self.error is not None:
            return "failed"
        return "unfinished"

    def status_line(self) -> str:
        if self.result is not None:
            return f"finished: {RESULT_FILE} written"
        if self.error is not None:
            return f"failed: {ERROR_FILE} says: {self.error}"
        return f"no {RESULT_FILE}: the run is still going, or was stopped or killed before its end"

    def keys(self) -> set[str]:
        return {k for r in self.rows.values() for k in r}

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``key``'s finite values by step (steps without it are left out)."""
        xs: list[int] = []
        ys: list[float] = []
        for step in sorted(self.rows):
            v = _number(self.rows[step].get(key))
            if v is not None:
                xs.append(step)
                ys.append(v)
        return xs, ys

    def value(self, step: int, key: str) -> float | None:
        return _number(self.rows.get(step, {}).get(key))

    def config_value(self, dotted: str) -> Any:
        """``a.b.c`` of config.yaml, or None when absent."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def read_jsonl(path: str) -> JsonlFile:
    """Every line of ``path`` that is a JSON object; the others by number.
    A last line without its newline is a write cut short (the trainer writes
    and flushes whole lines)."""
    rows: list[dict[str, Any]] = []
    bad: list[int] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    partial = bool(lines) and not lines[-1].endswith("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad.append(i)
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(i)
    return JsonlFile(rows, bad, partial)


def _step_of(row: dict[str, Any]) -> int | None:
    step = row.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _read_metrics(run: RunData) -> None:
    path = os.path.join(run.path, METRICS_FILE)
    if not os.path.isfile(path):
        run.notes.append(f"no {METRICS_FILE}: no step was logged (the run has not reached its first step, "
                         "or logging.sinks leaves out jsonl); every plot is empty")  # fmt: skip
        return
    data = read_jsonl(path)
    for row in data.rows:
        step = _step_of(row)
        if step is None:
            continue
        # Rows of one step logged in several lines are merged, later values winning.
        run.rows.setdefault(step, {}).update(row)
    if data.bad_lines:
        where = ", ".join(map(str, data.bad_lines[:5])) + (" ..." if len(data.bad_lines) > 5 else "")
        cut = " (the last one cut short: the run was killed while writing it, or is writing it now)"
        run.notes.append(
            f"{METRICS_FILE}: line(s) {where} unreadable and left out" + (cut if data.last_line_partial else "")
        )
    if not run.steps:
        run.notes.append(f"{METRICS_FILE} holds no training step yet (rows with {STEP_KEY})")


def _read_samples(run: RunData) -> None:
    path = os.path.join(run.path, SAMPLES_FILE)
    if not os.path.isfile(path):
        run.notes.append(f"no {SAMPLES_FILE}: which samples each step trained on is unknown")
        return
    data = read_jsonl(path)
    for row in data.rows:
        step = _step_of(row)
        if step is not None:
            run.samples[step] = row
    if data.bad_lines:
        run.notes.append(f"{SAMPLES_FILE}: line(s) {', '.join(map(str, data.bad_lines[:5]))} unreadable and left out")


def _read_config(run: RunData) -> None:
    path = os.path.join(run.path, CONFIG_FILE)
    if not os.path.isfile(path):
        run.notes.append(f"no {CONFIG_FILE}: the config summary is empty")
        return
    import yaml

    with open(path, encoding="utf-8", errors="replace") as f:
        run.config_text = f.read()
    try:
        loaded = yaml.safe_load(run.config_text)
    except yaml.YAMLError as e:
        run.notes.append(f"{CONFIG_FILE} is not valid YAML ({str(e).splitlines()[0]}); shown as text only")
        return
    if isinstance(loaded, dict):
        run.config = loaded


def _read_result(run: RunData) -> None:
    path = os.path.join(run.path, RESULT_FILE)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
            run.result = loaded if isinstance(loaded, dict) else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            run.notes.append(f"{RESULT_FILE} is unreadable (cut short?)")
    err = os.path.join(run.path, ERROR_FILE)
    if run.result is None and os.path.isfile(err):
        run.error = _last_line(err) or "(empty)"
    if run.result is None:
        run.notes.append(run.status_line())


def _last_line(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line.rstrip() for line in f if line.strip()]
    return lines[-1][:300] if lines else ""


def _read_servers(run: RunData) -> None:
    def index(p: str) -> int:
        m = re.search(r"server-(\d+)\.log$", p)
        return int(m.group(1)) if m else 0

    for path in sorted(glob.glob(os.path.join(run.path, "server-*.log")), key=index):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        lines = [line.strip() for line in re.split(r"[\r\n]+", text) if line.strip()]
        starts = sum(1 for line in lines if line.startswith(SERVER_START))
        run.servers.append(ServerLog(os.path.basename(path), starts, lines[-1][:300] if lines else ""))


def read_run(path: str) -> RunData:
    """Everything the report shows of the run in ``path``.

    Raises :class:`RunDirError` only when ``path`` is not a directory."""
    if not os.path.exists(path):
        raise RunDirError(f"run directory {path!r} does not exist (give the run_dir of an `areal train` run)")
    if not os.path.isdir(path):
        raise RunDirError(f"{path!r} is a file, not a run directory (give the run_dir of an `areal train` run)")
    real = os.path.abspath(path)
    run = RunData(path=real, name=os.path.basename(real.rstrip(os.sep)) or real)
    _read_config(run)
    _read_metrics(run)
    _read_samples(run)
    _read_result(run)
    _read_servers(run)
    return run


def step_samples(run: RunData, step: int) -> dict[str, Any]:
    """``samples.jsonl``'s record of ``step``; a step it lacks is an
    :class:`ArealError` naming the steps it has."""
    if not run.samples:
        raise ArealError(f"{os.path.join(run.path, SAMPLES_FILE)} records no step: nothing to inspect")
    if step not in run.samples:
        have = sorted(run.samples)
        contiguous = have == list(range(have[0], have[-1] + 1))
        valid = f"{have[0]}..{have[-1]}" if contiguous else ", ".join(map(str, have))
        raise ArealError(f"step {step} is not in {SAMPLES_FILE} of {run.path}: valid steps are {valid}")
    return run.samples[step]
