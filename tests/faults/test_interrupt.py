"""Ctrl-C / SIGTERM during a real ``areal train``, before its first periodic
recovery checkpoint: the run writes one at the step boundary, says so, and
the same command resumes from it; a rerun that cannot resume says why.

Same tiny model and settings as ``test_recovery.py`` (rewards all 0, an
entropy bonus, so equal final weights mean the same samples were trained in
the same batches). Each case is two or three real ``areal train`` processes
(a server start each), which is why the file takes a few minutes.
"""

import json
import os
import re
import signal

import pytest

from areal_kernel.checkpoint import CheckpointManager
from areal_kernel.testing.models import make_tiny_chat_llama
from areal_kernel.testing.recovery import (
    EXACT_SERVER,
    assert_bit_equal,
    interrupt_after_step,
    load_weights,
    read_samples,
    run_train,
    trained_steps,
)
from resume_checks import assert_async_run_complete  # pytest puts this directory on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "grpo_arithmetic.yaml")
STEPS = 5
INTERRUPTED_EXIT = 130


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_chat_llama(tmp_path_factory.mktemp("tiny-interrupt"))


def _args(model, run_dir, staleness, *extra):
    # checkpoint.save_every stays at its default (10 > STEPS): no periodic checkpoint is ever written.
    return [
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}",
        f"trainer.max_steps={STEPS}", "trainer.batch_size=2", "trainer.eval_size=2",
        "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=6", f"rollout.max_staleness={staleness}",
        "weight_update.mode=disk", "algorithm.dynamic_filter=false", "algorithm.entropy_coef=0.05",
        "actor.torch.lr=1e-3", "logging.sinks=[console, jsonl]", *EXACT_SERVER, *extra,
    ]  # fmt: skip


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _interrupted_at(proc) -> int:
    """The step the interrupted run says it saved, checked against its whole message."""
    assert proc.returncode == INTERRUPTED_EXIT, proc.stdout[-3000:]
    m = re.search(r"interrupted at step (\d+): writing a recovery checkpoint \(at most 120 s", proc.stdout)
    assert m, proc.stdout[-3000:]
    k = int(m.group(1))
    assert f"run the same command to resume from step {k}" in proc.stdout, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    return k


def test_sigint_before_the_first_checkpoint_resumes_exactly(tiny_model, tmp_path):
    """SIGINT to the process group once step 2 is logged: a recovery
    checkpoint of the step it stopped after (2, or 3 if step 3 was under
    way), exit code 130; the rerun says it resumes from that step and ends
    with the samples and weights of a run that was never interrupted."""
    ref_dir, run_dir = str(tmp_path / "reference"), str(tmp_path / "interrupted")
    _ok(run_train(_args(tiny_model, ref_dir, 0)))

    proc = interrupt_after_step(_args(tiny_model, run_dir, 0), run_dir, step=2, sig=signal.SIGINT)
    k = _interrupted_at(proc)
    assert 2 <= k < STEPS
    assert [c.step for c in CheckpointManager(os.path.join(run_dir, "recover")).complete()] == [k]
    assert trained_steps(run_dir) == list(range(1, k + 1))
    assert not os.path.exists(os.path.join(run_dir, "result.json"))

    resumed = run_train(_args(tiny_model, run_dir, 0))
    _ok(resumed)
    assert f"resuming from step {k} " in resumed.stdout, resumed.stdout[-3000:]
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["resumed_from_step"] == k and result["samples"] == STEPS * 2 * 4
    assert trained_steps(run_dir) == list(range(1, STEPS + 1))

    ref, got = read_samples(ref_dir), read_samples(run_dir)
    assert [s["uids"] for s in got] == [s["uids"] for s in ref]

    a = load_weights(os.path.join(ref_dir, "checkpoints", "final"))
    b = load_weights(os.path.join(run_dir, "checkpoints", "final"))
    base = load_weights(tiny_model)
    assert max(float((a[n] - base[n]).abs().max()) for n in a if n in base) > 1e-4  # training moved the weights
    assert_bit_equal(b, a)


def test_sigterm_of_an_async_run_resumes_without_losing_or_repeating_samples(tiny_model, tmp_path):
    """SIGTERM (what schedulers send) with rollouts running ahead
    (max_staleness 1): the checkpoint holds the finished groups not yet
    trained and the staleness accounting, so the resumed run keeps the
    steps before it as they were, trains no sample twice, and every batch
    stays full and within the staleness bound."""
    run_dir = str(tmp_path / "async")
    args = _args(tiny_model, run_dir, 1)
    proc = interrupt_after_step(args, run_dir, step=2, sig=signal.SIGTERM)
    k = _interrupted_at(proc)
    assert "SIGTERM received" in proc.stdout
    before = read_samples(run_dir)
    assert [s["step"] for s in before] == list(range(1, k + 1))

    resumed = run_train(args)
    _ok(resumed)
    assert f"resuming from step {k} " in resumed.stdout, resumed.stdout[-3000:]
    got = assert_async_run_complete(run_dir, STEPS, per_step=2, batch=8, staleness=1)
    assert got[:k] == before


def test_interrupt_checkpoint_cut_short_and_the_rerun_says_why_it_starts_over(tiny_model, tmp_path):
    """A checkpoint that cannot finish within ``checkpoint.interrupt_timeout_s``
    is abandoned the way a second Ctrl-C abandons it (a signal into the
    controller while it writes): the run exits, leaving no checkpoint at all,
    complete or partial. The rerun then says it starts at step 0 and why, and
    that the earlier run's metrics are kept in ``metrics.jsonl.prev``."""
    run_dir = str(tmp_path / "cut")
    # 1 ms: the drain and the write cannot finish in time.
    proc = interrupt_after_step(
        _args(tiny_model, run_dir, 0, "checkpoint.interrupt_timeout_s=0.001"), run_dir, step=2, sig=signal.SIGINT
    )
    assert proc.returncode == INTERRUPTED_EXIT, proc.stdout[-3000:]
    m = re.search(r"recovery checkpoint of step (\d+) abandoned \(not finished within 0.001 s\)", proc.stdout)
    assert m, proc.stdout[-3000:]
    assert "the same command will start over" in proc.stdout
    mgr = CheckpointManager(os.path.join(run_dir, "recover"))
    assert mgr.complete() == [] and mgr.partials() == []
    earlier = trained_steps(run_dir)
    assert len(earlier) >= 2

    rerun = run_train(_args(tiny_model, run_dir, 0, "trainer.max_steps=1"))
    _ok(rerun)
    recover = os.path.join(run_dir, "recover")
    assert f"starting at step 0: no recovery checkpoint in {recover}" in rerun.stdout, rerun.stdout[-3000:]
    assert "metrics of the earlier run kept in metrics.jsonl.prev" in rerun.stdout
    assert trained_steps(run_dir) == [1]
    with open(os.path.join(run_dir, "metrics.jsonl.prev")) as f:
        prev = [json.loads(line)["step"] for line in f if "perf/step_s" in line]
    assert prev == earlier
