"""The prefork server (``areal_kernel.utils.prefork``): a program started
through it behaves as one started by a fresh ``python -m``, and a start it
cannot make exactly is a plain one. Real processes throughout: a real
server with the real preload list, real forks, pipes and signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from areal_kernel.utils import prefork
from areal_kernel.utils.procs import ParentWatch, stat_fields

PROGRAM = """
import os, sys, threading, time
mode = sys.argv[1]
print("main", __name__, sys.argv[0].endswith("prog.py"), os.getcwd(), os.environ.get("AREAL_PROBE"),
      "torch" in sys.modules, os.getpgrp() == os.getpid(), sys.path[0] == os.getcwd(), flush=True)
print("to stderr", file=sys.stderr)
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "echo":
    print("read", sys.stdin.read().strip())
if mode == "thread":  # a non-daemon thread the interpreter's exit waits for
    threading.Thread(target=lambda: (time.sleep(0.3), open("thread.txt", "w").write("joined"))).start()
if mode == "unflushed":  # never closed: the interpreter's exit flushes it
    KEEP = open("unflushed.txt", "w")
    KEEP.write("x" * 100)
if mode == "raise":
    raise ValueError("boom from the program")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "sleep":
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = prefork.start_server(str(tmp_path_factory.mktemp("prefork")))
    yield srv
    srv.stop()


@pytest.fixture
def program(tmp_path: Path, server, monkeypatch: pytest.MonkeyPatch):
    """A package with ``PROGRAM`` as ``pkg.prog``; returns (env, cwd) for starting it."""
    (tmp_path / "site" / "pkg").mkdir(parents=True)
    (tmp_path / "site" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "site" / "pkg" / "prog.py").write_text(textwrap.dedent(PROGRAM))
    (tmp_path / "work").mkdir()
    monkeypatch.setenv(prefork.PREFORK_ENV, server.socket_path)
    path = os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "AREAL_PROBE": "probe-value"}
    return env, str(tmp_path / "work")


def start(mode: str, *args: str, env, cwd, **kw) -> subprocess.Popen:
    return prefork.popen([sys.executable, "-m", "pkg.prog", mode, *args], env=env, cwd=cwd, **kw)


def test_a_program_runs_as_under_a_fresh_interpreter(program):
    env, cwd = program
    r = prefork.run([sys.executable, "-m", "pkg.prog", "exit", "7"], env=env, cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 7, r
    # __main__, argv[0] the module's file, its cwd and environment, torch already
    # there, the caller's process group, cwd first on sys.path (as `python -m`).
    assert r.stdout.split() == ["main", "__main__", "True", cwd, "probe-value", "True", "False", "True"], r.stdout
    assert r.stderr == "to stderr\n"
    p = start("echo", env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.preforked
    out, _ = p.communicate("hello", timeout=60)
    assert p.returncode == 0 and out.splitlines()[-1] == "read hello"


def test_the_interpreter_exit_joins_threads_and_flushes_files(program):
    env, cwd = program
    for mode, name, text in (("thread", "thread.txt", "joined"), ("unflushed", "unflushed.txt", "x" * 100)):
        p = start(mode, env=env, cwd=cwd, stdout=subprocess.DEVNULL)
        assert p.preforked and p.wait(60) == 0
        assert (Path(cwd) / name).read_text() == text


def test_errors_and_signals_end_the_program_as_they_would_a_fresh_one(program):
    env, cwd = program
    r = prefork.run([sys.executable, "-m", "pkg.prog", "raise"], env=env, cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 1 and "ValueError: boom from the program" in r.stderr
    r = prefork.run([sys.executable, "-m", "pkg.prog", "interrupt"], env=env, cwd=cwd, capture_output=True, text=True)
    assert r.returncode == -signal.SIGINT, r  # death by SIGINT, as CPython reports an uncaught Ctrl-C
    p = start("sleep", env=env, cwd=cwd, stdout=subprocess.DEVNULL, start_new_session=True)
    assert p.preforked
    fields = stat_fields(p.pid)
    assert fields is not None and int(fields[1]) != os.getpid()  # a real process, kept by the server
    assert int(fields[2]) == p.pid  # leads its own group (and session)
    # Its own command line, as ps and process finders read it, not the server's.
    cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes()
    assert cmdline.split(b"\0")[:-1] == [os.fsencode(a) for a in p.args], cmdline
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL


def test_a_start_it_cannot_make_exactly_is_a_plain_one(program, server, tmp_path):
    env, cwd = program
    # A variable the preloaded packages read when imported: a plain start.
    p = start("exit", "3", env={**env, "HF_HOME": str(tmp_path / "hf")}, cwd=cwd, stdout=subprocess.DEVNULL)
    assert not p.preforked and p.wait(120) == 3
    # A directory on PYTHONPATH that would shadow a preloaded package.
    (tmp_path / "shadow" / "torch").mkdir(parents=True)
    shadowed = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), env["PYTHONPATH"]])}
    p = start("exit", "4", env=shadowed, cwd=cwd, stdout=subprocess.DEVNULL)
    assert not p.preforked and p.wait(120) == 4
    # Not `python -m`: a plain start.
    p = prefork.popen([sys.executable, "-c", "raise SystemExit(5)"], env=env)
    assert not p.preforked and p.wait(60) == 5
    log = Path(server.log_path).read_text()
    assert "HF_HOME differs" in log and f"{tmp_path / 'shadow'} holds torch" in log


def test_no_server_means_plain_starts(program, monkeypatch, tmp_path):
    env, cwd = program
    monkeypatch.setenv(prefork.PREFORK_ENV, str(tmp_path / "no-such-socket"))
    p = start("exit", "0", env=env, cwd=cwd, stdout=subprocess.DEVNULL)
    assert not p.preforked and p.wait(120) == 0


def test_the_server_ends_with_its_parent(tmp_path):
    code = (
        "import sys, time; from areal_kernel.utils import prefork; "
        f"s = prefork.start_server({str(tmp_path)!r}, preload=('json',)); "
        "print(s.proc.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    server_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        fields = stat_fields(server_pid)
        if fields is None or fields[0] in ("Z", "X"):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the prefork server {server_pid} outlived its parent by 30 s")


def test_parent_watch_follows_the_process_not_the_direct_parent():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        watch = ParentWatch(other.pid)  # not our parent: watched through a pidfd
        assert not watch.direct and not watch.gone()
        other.kill()
        other.wait()
        assert watch.gone()
    finally:
        if other.poll() is None:
            other.kill()
    assert not ParentWatch(os.getppid()).gone()
    assert ParentWatch(os.getppid()).direct


def test_a_starter_whose_environment_changed_sees_its_server_drifted(server):
    assert server.drifted(server.base_env) is None
    # What preloading itself set in the environment (torch: its inductor cache
    # directory) a fresh start would set too: no drift.
    changes = json.loads(Path(server.socket_path + prefork.IMPORT_ENV_SUFFIX).read_text())
    for key, value in changes.items():
        assert server.drifted({**server.base_env, key: value}) is None, key
        assert server.drifted({**server.base_env, key: value + "-other"}) is not None, key
    assert server.drifted({**server.base_env, "AREAL_ANYTHING": "1", "RANK": "3"}) is None
    reason = server.drifted({**server.base_env, "LD_LIBRARY_PATH": "/opt/elsewhere"})
    assert reason == "environment variable LD_LIBRARY_PATH differs from the server's"
