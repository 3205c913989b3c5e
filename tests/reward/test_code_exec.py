"""``code_exec``: untrusted Python in a real sandboxed subprocess (real
rlimits, real fork/alloc attempts, real process-group kill)."""
from __future__ import annotations

import os

import pytest

from areal_kernel.reward.code_exec import code_exec_reward, extract_code, run_untrusted
from areal_kernel.testing.contracts import RewardContract

RIGHT = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"


class TestCodeExecContract(RewardContract):
    @pytest.fixture
    def reward_target(self) -> str:
        return "areal_kernel.reward.code_exec:code_exec_reward"

    @pytest.fixture
    def reward_cases(self) -> list[tuple[str, str, float]]:
        return [(RIGHT, TESTS, 1.0), (WRONG, TESTS, 0.0), ("def add(a, b): return a + b", TESTS, 1.0)]


def test_registered_by_the_builtin_plugin():
    from areal_kernel.plugins import get_registry

    spec = get_registry().get("reward", "code_exec", platform="")
    assert spec.load() is code_exec_reward


def test_extracts_the_last_fenced_block():
    assert extract_code("```py\nx = 1\n```\ntext\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_code("plain = 3") == "plain = 3"


def test_syntax_error_and_exception_score_zero():
    assert code_exec_reward("def add(a, b) return", TESTS) == 0.0
    assert code_exec_reward("def add(a, b):\n    raise RuntimeError('no')", TESTS) == 0.0


def test_infinite_loop_is_killed_at_the_time_limit():
    res = run_untrusted("while True:\n    pass\n", timeout_s=1.0)
    assert res.timed_out and res.returncode is None
    assert code_exec_reward("def add(a, b):\n    while True:\n        pass", TESTS, timeout_s=1.0) == 0.0


def test_memory_bomb_hits_the_address_space_limit():
    res = run_untrusted("x = bytearray(4 * 1024 ** 3)\nprint('allocated')\n", memory_mb=256, timeout_s=20)
    assert not res.timed_out and res.returncode != 0
    assert "MemoryError" in res.stderr and "allocated" not in res.stdout


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is ``pgid``."""
    members = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after ")".
                    state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
            except OSError:
                continue
            if int(pgrp) == pgid and state != "Z":
                members.append(int(pid))
    return members


def test_fork_bomb_is_contained_and_cleaned_up():
    # The bomb prints its own pid (the sandbox's process group, see
    # run_untrusted's start_new_session) and each child's pid, so the clean-up
    # is checked on exactly these processes, as root or not.
    bomb = (
        "import os, time\n"
        "print('group', os.getpid(), flush=True)\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as e:\n"
        "        print('fork refused after', n, flush=True)\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    print('child', pid, flush=True)\n"
        "    n += 1\n"
    )
    res = run_untrusted(bomb, timeout_s=3.0, max_processes=6)
    assert "fork refused after" in res.stdout, res.stdout + res.stderr
    forks = int(res.stdout.split("fork refused after")[1].split()[0])
    children = [int(line.split()[1]) for line in res.stdout.splitlines() if line.startswith("child ")]
    assert len(children) == forks >= 1
    # As root the sandbox runs as nobody with NPROC 6; as another user NPROC
    # also counts that user's other processes (run_untrusted adds them), so
    # the bound holds only while their number stays put.
    assert forks <= 6
    group = int(res.stdout.split("group", 1)[1].split()[0])
    # The sleeping children (60 s) died with the process group before
    # run_untrusted returned: none is left in it.
    left = _group_members(group)
    assert left == [], f"left in the sandbox's process group {group}: {left} (children were {children})"


def test_parent_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("AREAL_TEST_SECRET_TOKEN", "hunter2")
    monkeypatch.setenv("PYTHONPATH", "/should/not/leak")
    res = run_untrusted(
        "import os, sys\nprint(sorted(os.environ))\nprint(os.environ.get('AREAL_TEST_SECRET_TOKEN'))\nprint(sys.path)\n"
    )
    assert res.returncode == 0, res.stderr
    names, secret, path = res.stdout.splitlines()
    assert set(eval(names)) <= {"PATH", "LANG", "HOME", "LC_CTYPE"}
    assert secret == "None" and "/should/not/leak" not in path
    assert "hunter2" not in res.stdout
