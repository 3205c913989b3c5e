"""RewardPool with real worker processes: timeouts, crashes, errors, concurrency."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.reward import RewardPool, RewardResult, math_verify_reward
from areal_kernel.testing.procs import wait_gone

HELPERS = "areal_h3_reward_helpers"


@pytest.fixture(scope="module", autouse=True)
def helpers_on_path():
    # Workers receive the parent's sys.path when they start.
    here = str(Path(__file__).parent)
    sys.path.insert(0, here)
    yield
    sys.path.remove(here)


@pytest.fixture(scope="module")
def pool(helpers_on_path):
    with RewardPool(n_workers=2, timeout_s=60.0) as p:
        yield p






def test_builtin_rewards_by_name_and_path(pool):
    r = pool.score("math", "The answer is 8.", "8")
    assert isinstance(r, RewardResult) and (r.score, r.ok, r.error) == (1.0, True, None)
    assert pool.score("math", "18", "8").score == 0.0
    assert pool.score("areal_kernel.reward.math:math_verify_reward", "\\boxed{8}", "8").score == 1.0
    assert pool.score("exact_match", "The answer is 8.", "8").score == 1.0
    # Keyword arguments reach the function.
    assert pool.score("exact_match", "The answer is 8.", "8", strict=True).score == 0.0
    assert pool.score(f"{HELPERS}:length_ratio", "abcd", "ab", scale=0.5).score == 1.0


def test_runs_in_other_processes(pool):
    pids = {int(pool.score(f"{HELPERS}:worker_pid", "", "").score) for _ in range(6)}
    assert os.getpid() not in pids
    assert pids <= set(pool.worker_pids())


def test_raising_reward_returns_the_error(pool):
    before = pool.stats()
    r = pool.score(f"{HELPERS}:raise_value_error", "xyz", "1")
    assert (r.ok, r.score) == (False, 0.0)
    assert r.error == "ValueError: cannot grade 'xyz'"
    after = pool.stats()
    assert after["failures"] == before["failures"] + 1 and after["restarts"] == before["restarts"]


def test_non_number_is_an_error(pool):
    r = pool.score(f"{HELPERS}:not_a_number", "x", "1")
    assert not r.ok and "expected a finite number" in r.error


def test_crashing_worker_is_replaced(pool):
    before = pool.stats()
    r = pool.score(f"{HELPERS}:crash", "x", "1")
    assert not r.ok and r.error == "worker crashed (exit code 7)"
    assert pool.stats()["crashes"] == before["crashes"] + 1
    assert all(pool.score("math", str(i), str(i)).score == 1.0 for i in range(4))


def test_unimportable_function_is_a_config_error(pool):
    with pytest.raises(ConfigError, match="no_such_module_h3:f.*ModuleNotFoundError"):
        pool.score("no_such_module_h3:f", "x", "1")
    with pytest.raises(ConfigError, match="'math_verify'.*has no attribute|AttributeError"):
        pool.score("areal_kernel.reward.math:math_verify", "x", "1")
    with pytest.raises(ConfigError, match="package.module:function"):
        pool.score("justaname", "x", "1")


def test_many_concurrent_calls_match_in_process_scores(pool):
    cases = [(c, str(a)) for a in range(10) for c in (str(a), f"The answer is {a + 1}.", f"\\boxed{{{a}}}", f"{a}5")]

    async def run():
        return await asyncio.gather(*(pool.ascore("math", c, a) for c, a in cases))

    before = pool.stats()["calls"]
    results = asyncio.run(run())
    assert all(r.ok for r in results)
    assert [r.score for r in results] == [math_verify_reward(c, a) for c, a in cases]
    assert sum(r.score for r in results) == 20  # two right forms per answer
    assert pool.stats()["calls"] == before + len(cases)


def test_hung_reward_times_out_and_pool_recovers(tmp_path):
    pid_file = tmp_path / "child.pid"
    with RewardPool(n_workers=2, timeout_s=2.0) as pool:
        old_pids = set(pool.worker_pids())

        async def run():
            hung = pool.ascore(f"{HELPERS}:sleep_forever", "x", "1", child_pid_file=str(pid_file))
            others = [pool.ascore("exact_match", str(i), str(i)) for i in range(20)]
            return await asyncio.gather(hung, *others)

        hung, *others = asyncio.run(run())
        assert (hung.ok, hung.score, hung.error) == (False, 0.0, "timeout")
        # The other worker kept serving while one was stuck.
        assert all(r.ok and r.score == 1.0 for r in others)
        # The stuck worker and the child it started were killed and replaced.
        new_pids = set(pool.worker_pids())
        killed = old_pids - new_pids
        assert len(killed) == 1 and len(new_pids) == 2
        assert wait_gone(killed.pop())
        assert wait_gone(int(pid_file.read_text()))
        stats = pool.stats()
        assert (stats["timeouts"], stats["restarts"], stats["failures"]) == (1, 1, 1)
        # And the pool keeps working, on the replacement too.
        assert [pool.score("math", "\\boxed{5}", "5").score for _ in range(4)] == [1.0] * 4


def test_sync_timeout_then_reuse():
    with RewardPool(n_workers=1, timeout_s=1.5) as pool:
        r = pool.score(f"{HELPERS}:sleep_forever", "x", "1")
        assert r.error == "timeout" and r.elapsed_s >= 1.5
        assert pool.score("exact_match", "7", "7").score == 1.0


def test_close_stops_workers():
    pool = RewardPool(n_workers=2, timeout_s=10.0)
    assert pool.score("exact_match", "1", "1").score == 1.0
    pids = pool.worker_pids()
    pool.close()
    assert all(wait_gone(pid) for pid in pids)
    with pytest.raises(ArealError, match="closed"):
        pool.score("exact_match", "1", "1")


def test_bad_preload_is_reported():
    with RewardPool(n_workers=1, timeout_s=5.0, preload=["no_such_module_h3"]) as pool:
        with pytest.raises(ConfigError, match="no_such_module_h3"):
            pool.score("exact_match", "1", "1")


def test_bad_pool_arguments():
    with pytest.raises(ConfigError, match="n_workers"):
        RewardPool(n_workers=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        RewardPool(n_workers=1, timeout_s=0)


def test_importing_a_bound_reward_never_counts_against_a_call(tmp_path):
    # A reward module that takes 2.5 s to import, under a 1 s timeout (a
    # plugin importing torch on a loaded machine). A reward bound to the pool
    # (settings) is imported while a worker starts, a replacement's included.
    (tmp_path / "areal_h3_slow_import.py").write_text(
        "import os, time\ntime.sleep(2.5)\n\n"
        "def fine(completion, answer):\n    return 1.0\n\n"
        "def die(completion, answer):\n    os._exit(9)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        fine, die = "areal_h3_slow_import:fine", "areal_h3_slow_import:die"
        with RewardPool(n_workers=1, timeout_s=1.0, preload=(), settings={fine: {}}) as pool:
            assert pool.score(fine, "x", "1").ok
            assert pool.score(die, "x", "1").error.startswith("worker crashed")
            assert pool.score(fine, "x", "1").ok  # the replacement imported it at start-up
            assert pool.stats()["timeouts"] == 0
        # Negative control: the same function not bound is imported inside its
        # first call, which the timeout cuts short.
        with RewardPool(n_workers=1, timeout_s=1.0, preload=()) as pool:
            assert pool.score(fine, "x", "1").error == "timeout"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("areal_h3_slow_import", None)
