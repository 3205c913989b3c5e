"""Exact recovery through the real CLI: ``kill -9`` the trainer mid-run, run
the same command again (``recover: auto``, the default) and compare with a
run that was never interrupted.

The model is a tiny random Llama with SmolLM2's tokenizer. Its arithmetic
rewards are all 0, so the policy-gradient term is 0; an entropy bonus makes
every step's update depend on exactly which tokens were sampled, so equal
weights after the last step mean the same samples were regenerated and
trained on in the same batches.
"""

import json
import os

import pytest

from areal_kernel.testing.models import make_tiny_chat_llama
from areal_kernel.testing.recovery import (
    EXACT_SERVER,
    assert_bit_equal,
    kill_after_checkpoint,
    load_weights,
    read_samples,
    run_train,
)
from resume_checks import assert_async_run_complete  # pytest puts this directory on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "grpo_arithmetic.yaml")
STEPS = 5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_chat_llama(tmp_path_factory.mktemp("tiny-recovery"))


def _args(model, run_dir, staleness):
    return [
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}",
        f"trainer.max_steps={STEPS}", "trainer.batch_size=2", "trainer.eval_size=2",
        "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=6", f"rollout.max_staleness={staleness}",
        "weight_update.mode=disk", "algorithm.dynamic_filter=false", "algorithm.entropy_coef=0.05",
        "actor.torch.lr=1e-3", "checkpoint.save_every=1", "checkpoint.keep_last=2",
        "logging.sinks=[console, jsonl]", *EXACT_SERVER,
    ]  # fmt: skip


def _final_weights(run_dir):
    return load_weights(os.path.join(run_dir, "checkpoints", "final"))


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_samples_and_weights(tiny_model, tmp_path):
    """Synchronous rollouts (max_staleness 0), seeded sampling: the resumed
    run trains on the same sample ids in the same steps and ends with the
    same weights as an uninterrupted run."""
    ref_dir, run_dir = str(tmp_path / "reference"), str(tmp_path / "killed")
    ref = run_train(_args(tiny_model, ref_dir, 0))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    kill_after_checkpoint(_args(tiny_model, run_dir, 0), run_dir, step=2)
    assert not os.path.exists(os.path.join(run_dir, "result.json"))
    before_resume = read_samples(run_dir)
    assert [s["step"] for s in before_resume] == [1, 2, 3]  # step 3 trained after the checkpoint, then killed

    resumed = run_train(_args(tiny_model, run_dir, 0))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "step 2" in resumed.stdout
    result = json.load(open(os.path.join(run_dir, "result.json")))
    assert result["resumed_from_step"] == 2 and result["samples"] == STEPS * 2 * 4

    ref_samples, got = read_samples(ref_dir), read_samples(run_dir)
    assert [s["step"] for s in got] == list(range(1, STEPS + 1))  # step 3's line of the killed run was dropped
    assert [s["uids"] for s in got] == [s["uids"] for s in ref_samples]
    flat = [u for s in got for u in s["uids"]]
    assert len(flat) == len(set(flat)) == STEPS * 2  # no sample twice

    a, b = _final_weights(ref_dir), _final_weights(run_dir)
    assert set(a) == set(b)
    base = load_weights(tiny_model)
    moved = max(float((a[k] - base[k]).abs().max()) for k in a if k in base)
    assert moved > 1e-4  # training changed the weights, so equality below means something
    assert_bit_equal(b, a)

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f if "perf/step_s" in line]
    assert steps == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_killed_async_run_resumes_without_losing_or_repeating_samples(tiny_model, tmp_path):
    """Asynchronous rollouts (max_staleness 1): which rollout finishes first
    is up to timing, so the comparison is with the killed run itself: the
    steps it checkpointed are kept as they were, and over the whole run no
    sample is trained twice and the batches stay full."""
    run_dir = str(tmp_path / "async")
    args = _args(tiny_model, run_dir, 1)
    kill_after_checkpoint(args, run_dir, step=2)
    before = read_samples(run_dir)
    resumed = run_train(args)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    got = assert_async_run_complete(run_dir, STEPS, per_step=2, batch=8, staleness=1)
    assert got[:2] == before[:2]  # what was checkpointed is what the resumed run continued from


def test_recover_off_refuses_to_overwrite_an_unfinished_run(tiny_model, tmp_path):
    """A run_dir with an unfinished run's checkpoint and ``recover: off``:
    one clear error, and the checkpoint is untouched."""
    from areal_kernel.checkpoint import CheckpointManager

    run_dir = tmp_path / "unfinished"
    CheckpointManager(str(run_dir / "recover")).save(3, lambda p: open(os.path.join(p, "x"), "w").close())
    proc = run_train([*_args(tiny_model, str(run_dir), 0), "recover=off"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "recover: off" in err[0] and "recover=auto" in err[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert os.path.isfile(run_dir / "recover" / "step3" / "COMPLETE")


def test_resume_with_a_changed_config_is_refused(tiny_model, tmp_path):
    """Resuming with a different batch size would not be the same run: refused, naming the field."""
    from areal_kernel.checkpoint import CheckpointManager
    from areal_kernel.config.loader import load_config
    from areal_kernel.plugins import get_registry

    run_dir = tmp_path / "changed"
    cfg = load_config(EXAMPLE, _args(tiny_model, str(run_dir), 0)[2:], registry=get_registry())
    state = {"format": 1, "step": 1, "config": cfg.dump()}

    def write(path):
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump(state, f)

    CheckpointManager(str(run_dir / "recover")).save(1, write)
    proc = run_train([*_args(tiny_model, str(run_dir), 0), "trainer.batch_size=3"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trainer.batch_size" in proc.stderr and "cannot resume" in proc.stderr, proc.stderr
    assert os.path.isfile(run_dir / "recover" / "step1" / "trainer_state.json")


def test_the_hold_is_off_unless_asked_for(monkeypatch):
    """``AREAL_TEST_HOLD_AFTER_STEP`` (the testing aid ``kill_after_checkpoint``
    uses): unset or empty, no run holds; a step number is taken; anything
    else is one error naming the variable."""
    from areal_kernel.errors import ConfigError
    from areal_kernel.trainer.recovery import HOLD_ENV, hold_step_from_env

    monkeypatch.delenv(HOLD_ENV, raising=False)
    assert hold_step_from_env() is None
    monkeypatch.setenv(HOLD_ENV, "")
    assert hold_step_from_env() is None
    monkeypatch.setenv(HOLD_ENV, "3")
    assert hold_step_from_env() == 3
    for bad in ("0", "three", "-1"):
        monkeypatch.setenv(HOLD_ENV, bad)
        with pytest.raises(ConfigError, match=HOLD_ENV):
            hold_step_from_env()
