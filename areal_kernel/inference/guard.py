"""Parent guard: run a server command so that it ends when its parent does.

``python -m areal_kernel.inference.guard [--grace-s S] -- <server argv>``

Every process a scheduler spawns must exit once the process that keeps it
alive (``PARENT_PID_ENV``: the controller, or a scheduler's agent / step
wrapper on its node) is gone. The embedded server and the train ranks watch
it themselves; vLLM, SGLang and any other server a ``SubprocessLauncher``
starts do not, so the launcher runs their command under this guard:

- the server runs as the guard's child **in the guard's process group** (the
  group the scheduler made for the guard), so the launcher's handle keeps its
  meaning: its pid is the guard's, ``signal_group`` (SIGTERM, then SIGKILL)
  reaches the guard, the server and everything the server forked, and the
  log file is shared;
- the guard watches its parent (``PARENT_PID_ENV``, else the parent it
  started under) every ``POLL_S`` seconds; once it is gone, the guard sends
  SIGTERM to the group, waits ``--grace-s``, then SIGKILLs the group
  (itself last);
- SIGTERM/SIGINT sent to the guard alone are forwarded to the server (a
  signal sent to the group reaches the server directly as well, so it may
  see it twice; servers treat a repeated SIGTERM as the same request);
- the guard ends with the server's exit status: the same code, or death by
  the same signal, so port-clash (exit 98) and crash reports are unchanged;
- the server sees ``PARENT_PID_ENV`` set to the guard's pid, so a server
  that watches its parent itself watches the guard.

The guard exits with ``EXEC_FAILED_EXIT`` (127) when the server command
cannot be started at all (missing interpreter), after printing why.

This module imports only the standard library: it starts before, and
independently of, anything heavy.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

# Mirrors ``areal_kernel.api.scheduler.PARENT_PID_ENV`` (kept literal so the
# guard imports nothing of the kernel; a kernel test checks they agree).
PARENT_PID_ENV = "AREAL_PARENT_PID"
MODULE = "areal_kernel.inference.guard"
EXEC_FAILED_EXIT = 127
POLL_S = 0.5
DEFAULT_GRACE_S = 10.0


def guarded_command(argv: list[str], *, python: str | None = None, grace_s: float = DEFAULT_GRACE_S) -> list[str]:
    """``argv`` wrapped in the guard, run by ``python`` (default: this interpreter)."""
    return [python or sys.executable, "-m", MODULE, "--grace-s", f"{grace_s:g}", "--", *argv]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _say(msg: str) -> None:
    print(f"areal guard [{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


def run(argv: list[str], grace_s: float = DEFAULT_GRACE_S) -> int:
    """Run ``argv`` under the guard; returns the exit status to end with
    (negative: the signal the server died of)."""
    start_ppid = os.getppid()
    env_parent = os.environ.get(PARENT_PID_ENV, "")
    watched = int(env_parent) if env_parent.isdigit() else start_ppid
    # Only a guard that leads its own group may signal the group: started any
    # other way (by hand, in a test harness) the server gets a group of its own.
    own_group = os.getpgrp() == os.getpid()
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
    orphaned = False

    def forward(sig: int, _frame: object) -> None:
        if not orphaned and child.poll() is None:
            try:
                os.kill(child.pid, sig)
            except ProcessLookupError:
                pass

    try:
        child = subprocess.Popen(argv, env=env, process_group=None if own_group else 0)
    except OSError as e:
        _say(f"cannot start {argv[0]!r}: {e}")
        return EXEC_FAILED_EXIT
    group = os.getpgrp() if own_group else child.pid
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)

    while True:
        try:
            return child.wait(POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() == start_ppid and _alive(watched):
            continue
        orphaned = True
        _say(f"parent process {watched} is gone; stopping the server (pid {child.pid}, group {group})")
        # Ignore our own SIGTERM to the group; the server gets grace_s to exit cleanly.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        # Whatever is left of the group (the server's own children too), and us last.
        if group != os.getpgrp():
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return child.wait()
        os.killpg(group, signal.SIGKILL)
        return 128 + signal.SIGKILL  # not reached: the guard is in the group


def main(args: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S, help="SIGTERM-to-SIGKILL grace on parent loss")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the server command")
    ns = p.parse_args(args)
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        p.error("no server command given (expected: -- <server argv>)")
    rc = run(argv, ns.grace_s)
    if rc < 0:
        # Die of the same signal, so our parent sees what the server saw.
        if -rc not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be handled
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
        time.sleep(1)
    sys.exit(rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    main()
