"""Rank processes: errors come back with their type, and no rank outlives its controller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from areal_kernel.errors import DataError
from areal_kernel.testing.procs import is_alive, wait_gone
from areal_kernel.testing.rank_engines import random_batch

pytestmark = pytest.mark.slow


def test_loss_error_on_the_ranks_is_reraised_and_the_engine_stays_usable(shared_engine):
    def bad_loss(logprobs, entropy, data):
        raise DataError("loss data lacks 'advantages'")

    batch = random_batch([6, 7, 8, 9], seed=1)
    with pytest.raises(DataError, match="lacks 'advantages'"):
        shared_engine.train_batch(batch, bad_loss)

    def good_loss(logprobs, entropy, data):
        return -(logprobs * data["loss_mask"]).sum() / data["batch_loss_tokens"], {}

    out = shared_engine.train_batch(batch, good_loss)
    assert out["skipped"] == 0.0 and out["grad_norm"] > 0


def test_ranks_die_with_their_controller(tiny_model_dir, tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        from areal_fsdp.engine import FSDPTrainEngine
        e = FSDPTrainEngine({{}}, world_size=2, log_dir={str(tmp_path)!r})
        e.initialize({tiny_model_dir!r}, 2)
        print(" ".join(str(p.pid) for p in e.ranks.procs), flush=True)
        time.sleep(600)
        """
    )
    ctrl = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    rank_pids: list[int] = []
    try:
        line = ctrl.stdout.readline()
        rank_pids = [int(x) for x in line.split()]
        assert len(rank_pids) == 2, f"controller printed {line!r}"
        assert all(is_alive(pid) for pid in rank_pids), rank_pids
        os.killpg(ctrl.pid, signal.SIGKILL)  # the controller dies without any cleanup
        ctrl.wait()
        # Orphaned, a rank is reaped by init: a zombie counts as gone (testing.procs).
        alive = [pid for pid in rank_pids if not wait_gone(pid, timeout_s=60)]
        assert not alive, f"ranks {sorted(alive)} outlived their controller"
    finally:
        if ctrl.poll() is None:
            os.killpg(ctrl.pid, signal.SIGKILL)
        for pid in rank_pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
