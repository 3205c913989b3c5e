"""The parent guard every ``SubprocessLauncher`` server runs under
(``areal_kernel.inference.guard``), with real processes.

The "server" here is a stand-in: a plain Python HTTP process answering
``/health`` with its pid (the guard is generic, so what the server is does
not matter to the mechanism; real vLLM/SGLang runs go through the same code)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from areal_kernel.api.scheduler import PARENT_PID_ENV
from areal_kernel.inference import guard
from areal_kernel.inference.launcher import SubprocessLauncher
from areal_kernel.testing.procs import is_alive

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Stand-in server: /health answers its pid and its PARENT_PID_ENV; with
# "stubborn" it ignores SIGTERM and forks a grandchild (so only the guard's
# SIGKILL of the whole group can end them).
STANDIN_SERVER = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys
    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    else:
        kid = None
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"{os.getpid()} {os.environ.get('AREAL_PARENT_PID')} {kid.pid if kid else 0}".encode()
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


class StandInLauncher(SubprocessLauncher):
    server_name = "stand-in server"

    def __init__(self, run_dir: str, mode: str = "plain", stop_grace_s: float = 2.0) -> None:
        self.mode = mode
        super().__init__(run_dir, startup_timeout_s=60, stop_grace_s=stop_grace_s)

    def command(self, model_path: str, port: int, index: int, device_ids: list[int]) -> list[str]:
        return [sys.executable, "-c", STANDIN_SERVER, str(port), self.mode]


def _health(address: str) -> list[int]:
    with urllib.request.urlopen(f"http://{address}/health", timeout=10) as r:
        return [int(x) for x in r.read().decode().split()]


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(is_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if is_alive(p)]


def test_guard_uses_the_scheduler_contract_variable() -> None:
    assert guard.PARENT_PID_ENV == PARENT_PID_ENV


# A controller that launches one stubborn stand-in and then hangs until killed.
CONTROLLER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[3])
    from test_server_guard import StandInLauncher
    lau = StandInLauncher(sys.argv[2], mode="stubborn", stop_grace_s=1.0)
    info = lau.launch(sys.argv[1], n_servers=1, devices_per_server=0)[0]
    print(info.pid, info.address, flush=True)
    time.sleep(600)
    """
)


def test_server_and_its_children_end_when_the_controller_is_killed(tmp_path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    here = os.path.dirname(os.path.abspath(__file__))
    ctl = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, str(tmp_path), str(tmp_path / "run"), here],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    guard_pid_s, address = ctl.stdout.readline().split()  # type: ignore[union-attr]
    guard_pid = int(guard_pid_s)
    server_pid, server_parent, grandchild = _health(address)
    # The handle's pid is the guard; the server runs under it, in its group,
    # and is told the guard is the parent to watch.
    assert server_pid != guard_pid and server_parent == guard_pid
    assert os.getpgid(server_pid) == guard_pid == os.getpgid(grandchild)
    ctl.send_signal(signal.SIGKILL)
    ctl.wait()
    try:
        left = _wait_gone([guard_pid, server_pid, grandchild])
        assert left == [], f"outlived the killed controller: {left}"
        log = (tmp_path / "run" / "server-0.log").read_text()
        assert "parent process" in log and "is gone" in log
    finally:
        try:
            os.killpg(guard_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_launcher_stop_and_restart_still_work_on_guarded_servers(tmp_path) -> None:
    lau = StandInLauncher(str(tmp_path / "run"))
    try:
        info = lau.launch(str(tmp_path), n_servers=1, devices_per_server=0)[0]
        server_pid, _, _ = _health(info.address)
        assert lau.exited() == {}
        # A crashed server: the guard ends with it, the launcher sees it and restarts.
        os.kill(server_pid, signal.SIGKILL)
        assert lau.handles[0].wait(30) == -signal.SIGKILL
        assert lau.exited() == {0: -signal.SIGKILL}
        again = lau.restart(0)
        assert again.address == info.address and again.pid != info.pid
        new_server, _, _ = _health(again.address)
    finally:
        lau.stop()
    assert _wait_gone([again.pid, new_server]) == []
    with pytest.raises(ProcessLookupError):
        os.killpg(again.pid, 0)


def test_stop_returns_once_no_process_of_the_group_runs(tmp_path) -> None:
    """A stubborn server (SIGTERM ignored, a grandchild of its own): stop()
    SIGKILLs the group and returns only when none of it runs, not as soon as
    the guard (the group's leader) is reaped: a killed vLLM engine core can
    still be freeing its GBs then, and `areal inf deregister` said "stopped"
    while it was."""
    from areal_kernel.utils.procs import group_running, wait_group_gone

    lau = StandInLauncher(str(tmp_path / "run"), mode="stubborn", stop_grace_s=0.5)
    try:
        info = lau.launch(str(tmp_path), n_servers=1, devices_per_server=0)[0]
        server_pid, _, grandchild = _health(info.address)
        assert os.getpgid(grandchild) == info.pid
        assert group_running(info.pid)
        assert not wait_group_gone(info.pid, 0.3)  # a running group is not waited out
    finally:
        lau.stop()
    assert not group_running(info.pid)
    assert not is_alive(server_pid) and not is_alive(grandchild)


def _run_guard(argv: list[str], **kw) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(guard.guarded_command(argv, grace_s=1), env=env, start_new_session=True, **kw)


def test_exit_status_of_the_server_is_the_guards() -> None:
    assert _run_guard([sys.executable, "-c", "import sys; sys.exit(98)"]).wait(30) == 98
    assert _run_guard([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]).wait(30) == -signal.SIGKILL
    missing = _run_guard(["/nonexistent/python", "-V"], stderr=subprocess.PIPE, text=True)
    assert missing.wait(30) == guard.EXEC_FAILED_EXIT
    assert "cannot start '/nonexistent/python'" in missing.stderr.read()  # type: ignore[union-attr]


def test_sigterm_to_the_guard_alone_reaches_the_server() -> None:
    child = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('got TERM', flush=True), sys.exit(5)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    p = _run_guard([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    os.kill(p.pid, signal.SIGTERM)  # the guard only, not its group
    assert p.wait(30) == 5
    assert "got TERM" in p.stdout.read()  # type: ignore[union-attr]
