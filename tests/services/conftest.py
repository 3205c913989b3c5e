"""Helpers of the ``areal inf`` tests: the real CLI in subprocesses, each
test module with its own ``AREAL_HOME``, and process-group checks read from
``/proc`` (what "no process left" means)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("OMP_NUM_THREADS", "1")


class InfCLI:
    """``areal inf ...`` (or ``areal agent ...`` with ``command="agent"``) run
    as a real subprocess against one service directory."""

    def __init__(self, areal_home: Path, command: str = "inf") -> None:
        self.areal_home = areal_home
        self.command = command
        self.home = areal_home / command
        self.env = dict(os.environ, AREAL_HOME=str(areal_home), OMP_NUM_THREADS="1")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

    def __call__(self, *args: str, ok: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "areal_kernel.cli", self.command, *args],
            env=self.env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if ok:
            assert proc.returncode == 0, (
                f"areal {self.command} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
            )
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "--json").stdout)

    def fails(self, *args: str, **kw: Any) -> str:
        """Run a command that must fail with exactly one ``areal: error:`` line
        (exit code 2, no traceback); return that line."""
        proc = self(*args, ok=False, **kw)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, f"areal {self.command} {' '.join(args)}: rc {proc.returncode}\n{proc.stderr}"
        assert len(lines) == 1 and lines[0].startswith("areal: error: "), proc.stderr
        return lines[0]

    def state(self) -> dict[str, Any] | None:
        path = self.home / "gateway.json"
        return json.loads(path.read_text()) if path.exists() else None

    def wait_ready(self, name: str, timeout: float = 900) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.json("status", name)
            assert st["state"] != "failed", f"model {name} failed: {st['error']}"
            if st["state"] == "ready":
                return st
            assert time.monotonic() < deadline, f"model {name} still {st['state']} after {timeout} s"
            time.sleep(0.5)

    @staticmethod
    def process_groups() -> dict[int, list[int]]:
        """Process group id -> live (non-zombie) pids, from /proc."""
        from areal_kernel.testing.procs import live_processes

        out: dict[int, list[int]] = {}
        for p in live_processes():
            out.setdefault(p.pgid, []).append(p.pid)
        return out


@pytest.fixture(scope="module")
def inf_cli(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A CLI bound to a fresh ``AREAL_HOME``; whatever service it started is
    stopped at the end (and must leave no process)."""
    cli = InfCLI(tmp_path_factory.mktemp("areal-home"))
    yield cli
    state = cli.state()
    cli("stop", ok=False)
    if state is not None:
        groups = [state["pid"]] + [r["pid"] for rs in state.get("replicas", {}).values() for r in rs]
        left = {g: p for g, p in cli.process_groups().items() if g in groups}
        assert not left, f"processes left after `areal inf stop`: {left}"


@pytest.fixture(scope="module")
def agent_cli(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``areal agent ...`` bound to a fresh ``AREAL_HOME``; the service it
    started is stopped at the end and must leave no process behind."""
    cli = InfCLI(tmp_path_factory.mktemp("areal-home"), command="agent")
    yield cli
    cli("stop", ok=False)
    left = started_for(cli)
    assert not left, f"processes left after `areal agent stop`: {left}"


def started_for(cli: InfCLI) -> list[Any]:
    """Live processes started for ``cli``'s AREAL_HOME (services pass their environment on)."""
    from areal_kernel.testing.procs import live_processes

    return live_processes(lambda p: p.pid != os.getpid() and p.environ_has(f"AREAL_HOME={cli.areal_home}"))
