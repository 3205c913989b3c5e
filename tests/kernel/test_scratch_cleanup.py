"""Scratch that the kernel makes for itself in the system temp directory
goes away with a clean close and stays for a failure (its logs), with real
processes: a rank group (local scheduler, gloo) and a launcher without a
run_dir. And the suite's own rule (root ``conftest.py``): the system temp
directory of a test process, and of what it starts, is under pytest's base
directory, so nothing piles up outside it across runs."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from areal_kernel.config import resolve
from areal_kernel.config.models import ExperimentConfig
from areal_kernel.engine.ranks import RankError, RankGroup
from areal_kernel.errors import ServerError
from areal_kernel.inference.launcher import SubprocessLauncher
from areal_kernel.plugins import get_registry
from areal_kernel.scheduling.local import LocalScheduler

RANK_MODULE = '''
from areal_kernel.engine.ranks import rank_main


class Echo:
    def __init__(self, rank, world_size):
        self.rank = rank

    def echo(self, x):
        return (self.rank, x)

    def fail(self):
        raise RuntimeError(f"rank {self.rank} failed on purpose")


def main(argv=None):
    return rank_main(lambda rank, world_size: Echo(rank, world_size), "echo", argv)


if __name__ == "__main__":
    raise SystemExit(main())
'''

# Answers /health; with "die" it exits before becoming healthy.
SERVER = textwrap.dedent(
    """
    import http.server, sys
    port, mode = int(sys.argv[1]), sys.argv[2]
    print("stand-in server starting", flush=True)
    if mode == "die":
        sys.exit(3)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


class StandInLauncher(SubprocessLauncher):
    """A plain Python HTTP process as the server: what this test checks is
    the launcher's own directory, the same for every backend."""

    server_name = "stand-in server"

    def __init__(self, mode: str) -> None:
        self.mode = mode
        super().__init__(None, startup_timeout_s=60, stop_grace_s=2.0, port_retries=0)

    def command(self, model_path: str, port: int, index: int, device_ids: list[int]) -> list[str]:
        return [sys.executable, "-c", SERVER, str(port), self.mode]


@pytest.fixture
def system_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty system temp directory for this test alone: what is left in
    it afterwards is what the code left."""
    d = tmp_path / "system-tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _group(tmp_path: Path) -> tuple[RankGroup, LocalScheduler]:
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "echo_rank.py").write_text(textwrap.dedent(RANK_MODULE))
    sched = LocalScheduler(resolve(ExperimentConfig.model_validate({"actor": {"backend": "torch:d2"}}), get_registry()))
    group = RankGroup("echo", "echo_rank", 2, sched, None, startup_timeout_s=120, pythonpath=[str(code)])
    return group, sched


def test_a_rank_group_without_log_dir_removes_its_own_on_a_clean_shutdown(tmp_path, system_tmp):
    group, sched = _group(tmp_path)
    try:
        group.start()
        assert group.log_dir is not None and Path(group.log_dir).parent == system_tmp
        assert sorted(os.listdir(group.log_dir)) == ["rank-0.log", "rank-1.log"]
        group.call("create")
        assert group.call("echo", {"x": 7}) == [(0, 7), (1, 7)]
        group.shutdown()
    finally:
        group.stop()
        sched.stop()
    assert os.listdir(system_tmp) == []


def test_a_rank_group_keeps_its_logs_after_a_failure(tmp_path, system_tmp):
    group, sched = _group(tmp_path)
    try:
        group.start()
        group.call("create")
        with pytest.raises(RankError, match="failed on purpose"):
            group.call("fail")
        group.shutdown()
    finally:
        group.stop()
        sched.stop()
    assert group.log_dir is not None and Path(group.log_dir).parent == system_tmp
    assert sorted(os.listdir(group.log_dir)) == ["rank-0.log", "rank-1.log"]


def test_a_launcher_without_run_dir_removes_its_own_on_stop(tmp_path, system_tmp):
    launcher = StandInLauncher("serve")
    try:
        assert Path(launcher.run_dir).parent == system_tmp
        (info,) = launcher.launch(str(tmp_path), 1, 0)
        assert info.address and os.listdir(launcher.run_dir) == ["server-0.log"]
    finally:
        launcher.stop()
    assert os.listdir(system_tmp) == []


def test_a_launcher_keeps_the_log_of_a_server_that_failed(tmp_path, system_tmp):
    launcher = StandInLauncher("die")
    try:
        with pytest.raises(ServerError, match="exited with code 3"):
            launcher.launch(str(tmp_path), 1, 0)
    finally:
        launcher.stop()
    log = Path(launcher.run_dir) / "server-0.log"
    assert log.parent.parent == system_tmp and "stand-in server starting" in log.read_text()


def test_the_suite_keeps_the_system_temp_directory_under_pytests_base(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    assert Path(tempfile.gettempdir()).is_relative_to(base)
    assert Path(os.environ["TMPDIR"]).is_relative_to(base)
    # What the tests start inherits it (rank groups, servers, `areal train`).
    out = subprocess.run(
        [sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(out.stdout.strip()).is_relative_to(base)
