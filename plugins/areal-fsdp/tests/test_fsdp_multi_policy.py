"""Two policies in one ``areal train`` run on the fsdp engine (``policies:``
with ``actor.backend: fsdp:d2``, docs/multi-policy.md): two LoRA adapters on
the tiny byte-level Llama, trained by one pair of FSDP ranks, served by one
embedded server. The setup of the kernel's
``tests/e2e/test_multi_policy.py::test_weights_decide_the_order_and_each_policy_keeps_its_own_knobs``
with the train engine swapped: weights 2 and 1 set the order, each policy
trains its own batch size and staleness bound, each adapter's version counts
its own steps, every update reached the server intact, the KL reference is
the base with the adapters off (``score_base`` in the ranks), and each
policy's adapter is exported."""

from __future__ import annotations

import json
import os

import pytest

from areal_kernel.testing.learning import TINY_POLICY_MODEL, policy_rows, tiny_policies_override
from areal_kernel.testing.rank_engines import plugin_example

pytestmark = pytest.mark.slow

EXAMPLE = plugin_example(__file__, "grpo_arithmetic_fsdp.yaml")


def test_a_policy_with_a_critic_is_refused_in_one_line(run_areal, tmp_path):
    """A policy whose estimator needs values (``gae``: a critic per policy,
    which the torch engine runs) on fsdp, whose engine does not declare the
    ``critic`` capability: one line naming the policy and the field, before
    any rank or server starts."""
    from areal_kernel.testing.models import make_tiny_byte_chat_llama

    model = make_tiny_byte_chat_llama(tmp_path / "model", **TINY_POLICY_MODEL)
    proc = run_areal(
        "train", EXAMPLE, f"model.path={model}", f"run_dir={tmp_path / 'run'}",
        tiny_policies_override(extra={"digits": "algorithm: {advantage: gae}"}), timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if "policies.digits.algorithm.advantage='gae'" in line]
    assert len(lines) == 1 and "'critic' capability" in lines[0], out[-2000:]
    assert "starting inference servers" not in out and "Traceback" not in out
    assert not os.path.exists(tmp_path / "run" / "fsdp-ranks")


def test_two_policies_on_fsdp_ranks(run_areal, tmp_path):
    from areal_kernel.testing.models import make_tiny_byte_chat_llama

    model = make_tiny_byte_chat_llama(tmp_path / "model", **TINY_POLICY_MODEL)
    run_dir = str(tmp_path / "run")
    policies = (
        "policies={letters: {weight: 2, reward: {type: char_share, char_share: {chars: abc}}, "
        "algorithm: {kl_coef: 0.1}}, digits: {weight: 1, batch_size: 2, max_staleness: 0}}"
    )
    proc = run_areal(
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", "trainer.max_steps=3",
        "trainer.batch_size=4", "trainer.eval_size=0", "logging.sinks=[jsonl]", "reward.type=char_share",
        "actor.fsdp.lr=3e-2", policies, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 policies (letters, digits)" in proc.stdout
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    order = [
        "L" if "policy/letters/step" in r else "D"
        for r in lines
        if "policy/letters/step" in r or "policy/digits/step" in r
    ]
    assert order == ["L", "D", "L", "L", "D", "D"], order
    rows = {"letters": policy_rows(run_dir, "letters"), "digits": policy_rows(run_dir, "digits")}
    n = 8  # rollout.gconfig.n_samples of the example
    assert [r["batch/sequences"] for r in rows["letters"]] == [4 * n] * 3
    assert [r["batch/sequences"] for r in rows["digits"]] == [2 * n] * 3
    assert all(r["rollout/staleness_max"] == 0 for r in rows["digits"])
    for name, got in rows.items():
        assert [r["version"] for r in got] == [1, 2, 3]
        assert all(r["train/n_ranks"] == 2.0 and r["train/skipped"] == 0.0 for r in got)
        # Every update (the adapter alone: kilobytes) checked on the server, none mismatched.
        assert all(r["monitor/weights_checked"] > 0 and r["monitor/weights_mismatch"] == 0 for r in got)
        assert all(0 < r["weights/mb"] < 1 for r in got)
        assert os.path.isfile(os.path.join(run_dir, "checkpoints", f"final-{name}", "adapter_model.safetensors"))
    kl = [r["train/kl"] for r in rows["letters"]]
    print(f"\nletters on fsdp: KL to the base per step {kl}")
    assert kl[-1] > kl[0] >= 0, kl  # the base with the adapters off is the reference, the adapter moves off it
    assert not any("train/kl" in r for r in rows["digits"])
    assert sorted(os.listdir(os.path.join(run_dir, "fsdp-ranks"))) == ["rank-0.log", "rank-1.log"]


def test_two_policies_step_together_on_fsdp_ranks(run_areal, tmp_path):
    """``trainer.policy_order: together`` on ``fsdp:d2``: every global step
    trains both adapters in shared forwards on the ranks (``train/joint`` 1,
    the engine's ``train_policies``), each policy its own batch size, and
    every adapter update reaches the server intact."""
    from areal_kernel.testing.models import make_tiny_byte_chat_llama

    model = make_tiny_byte_chat_llama(tmp_path / "model", **TINY_POLICY_MODEL)
    run_dir = str(tmp_path / "run")
    policies = "policies={letters: {reward: {type: char_share, char_share: {chars: abc}}}, digits: {batch_size: 2}}"
    proc = run_areal(
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", "trainer.max_steps=2",
        "trainer.batch_size=4", "trainer.eval_size=0", "logging.sinks=[jsonl]", "reward.type=char_share",
        "trainer.policy_order=together", "actor.fsdp.lr=3e-2", policies, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {"letters": policy_rows(run_dir, "letters"), "digits": policy_rows(run_dir, "digits")}
    n = 8  # rollout.gconfig.n_samples of the example
    for name, size in (("letters", 4), ("digits", 2)):
        got = rows[name]
        assert [r["version"] for r in got] == [1, 2]
        assert [r["batch/sequences"] for r in got] == [size * n] * 2
        assert all(r["train/joint"] == 1.0 and r["train/n_ranks"] == 2.0 and r["train/skipped"] == 0.0 for r in got)
        assert all(r["train/grad_norm"] > 0 for r in got)
        assert all(r["monitor/weights_checked"] > 0 and r["monitor/weights_mismatch"] == 0 for r in got)


@pytest.mark.parametrize("order", ["weight", "together"])
def test_a_killed_two_policy_fsdp_run_resumes_every_policy(order, tmp_path):
    """``kill -9`` of a two-policy run on ``fsdp:d2`` after global step 4 was
    trained but before its checkpoint, then the same command (``recover:
    auto``): the same sample ids with the same adapter at every step as an
    uninterrupted run, and both adapters end where its did
    (``check_policies_resume``: the engine's checkpoint holds every adapter
    with its optimizer state, schedule step and version). ``together``: both
    policies at every step through the ranks' joint step, so the newest
    checkpoint at the kill is global step 2's."""
    from areal_kernel.testing.learning import TINY_POLICY_CHARS, TINY_POLICY_LR, tiny_policies_override
    from areal_kernel.testing.models import make_tiny_byte_chat_llama
    from areal_kernel.testing.recovery import EXACT_SERVER, check_policies_resume

    model = make_tiny_byte_chat_llama(tmp_path / "model", **TINY_POLICY_MODEL)

    def args(run_dir: str) -> list[str]:
        return [
            "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", "trainer.max_steps=4",
            "trainer.batch_size=2", "trainer.eval_size=0", "rollout.gconfig.n_samples=4",
            "rollout.gconfig.max_new_tokens=6", "rollout.max_staleness=0", "weight_update.mode=disk",
            "algorithm.dynamic_filter=false", f"actor.fsdp.lr={TINY_POLICY_LR}", "actor.fsdp.lr_scheduler=constant",
            "checkpoint.save_every=1", "checkpoint.keep_last=2", "logging.sinks=[jsonl]", tiny_policies_override(), *EXACT_SERVER,
            f"trainer.policy_order={order}",
        ]  # fmt: skip

    check_policies_resume(args, str(tmp_path), list(TINY_POLICY_CHARS), checkpoint_step=2 if order == "together" else 3)
