"""Two roles in one episode (examples/selfplay_arithmetic.yaml; docs/multi-policy.md,
"Several roles in one episode"): the asker's ``selfplay`` workflow writes
questions with its adapter and has the ``answerer`` adapter answer them; the
trainer routes each trajectory to the batch of the policy its adapter names
(``episodes_from``). Run through ``areal train`` on a tiny random byte-level
Llama with ``char_share`` rewards (graded on any text, so both roles' groups
have reward spread; ``asker_scoring: text``), 3 steps of each policy.

Checked: the steps alternate asker, answerer; each step's samples name one
adapter, the one of the policy that trained them; the answerer trains on the
answers of exactly the episodes the asker just trained on; the asker's
samples are questions (up to 10 tokens, and longer than any answer) and the
answerer's are answers (up to 3 tokens: its ``answer_tokens``), so neither
batch holds the other's tokens; each policy's versions are its own; both
exported adapters moved (lora_B starts at zero).
"""

from __future__ import annotations

import json
import os

import pytest

from areal_kernel.testing.learning import TINY_POLICY_LR, TINY_POLICY_MODEL, tiny_policy_lora
from e2e_paths import REPO

EXAMPLE = os.path.join(REPO, "examples", "selfplay_arithmetic.yaml")
QUESTION_TOKENS, ANSWER_TOKENS, STEPS = 10, 3, 3


@pytest.mark.parametrize("order", ["weight", "together"])
def test_selfplay_routes_each_role_to_its_policy_and_both_adapters_move(order, run_areal, tmp_path):
    """``together``: the answerer's step joins its driver's (the asker's batch
    routes its answers to it first), both adapters in shared forwards."""
    from areal_kernel.models.tiny import make_tiny_byte_chat_llama
    from areal_kernel.testing.recovery import load_weights

    model = make_tiny_byte_chat_llama(tmp_path / "model", **TINY_POLICY_MODEL)
    run_dir = str(tmp_path / "run")
    lora = tiny_policy_lora()
    proc = run_areal(
        "train", EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", f"trainer.max_steps={STEPS}",
        "trainer.batch_size=2", "trainer.eval_size=0", "logging.sinks=[jsonl]", "reward.type=char_share",
        f"actor.torch.lr={TINY_POLICY_LR}", "actor.torch.lr_scheduler=constant", "weight_update.mode=disk",
        "rollout.gconfig.n_samples=3", f"rollout.gconfig.max_new_tokens={QUESTION_TOKENS}",
        "rollout.gconfig.temperature=1.0", f"policies.asker.lora={lora}", f"policies.answerer.lora={lora}",
        "policies.asker.workflow.selfplay.asker_scoring=text", "policies.asker.workflow.selfplay.answers_per_question=2",
        f"policies.asker.workflow.selfplay.answer_tokens={ANSWER_TOKENS}", f"trainer.policy_order={order}",
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    adapters = [{s["adapter"] for s in line["samples"]} for line in lines]
    assert adapters == [{"asker"}, {"answerer"}] * STEPS, adapters
    for asked, answered in zip(lines[::2], lines[1::2]):
        # The answerer's batch: the answers of the episodes the asker's batch held.
        assert set(answered["uids"]) == set(asked["uids"]) and len(asked["uids"]) == 2
        questions, answers = asked["samples"], answered["samples"]
        assert len(questions) == 2 * 3 and len(answers) == 2 * 3 * 2
        assert all(0 < s["tokens"] <= QUESTION_TOKENS for s in questions)
        assert all(0 < s["tokens"] <= ANSWER_TOKENS for s in answers)
        assert max(s["tokens"] for s in questions) > ANSWER_TOKENS  # not answers in disguise
        assert all("#q" in s["sample"] and "a" not in s["sample"].rsplit("#q", 1)[1] for s in questions)
        # Each policy's tokens carry its own adapter's versions (both step once per round).
        step = asked["step"] // 2  # rounds before this one
        assert all(set(s["versions"]) <= {step - 1, step} for s in questions + answers), (questions, answers)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for name in ("asker", "answerer"):
        versions = [r[f"policy/{name}/version"] for r in rows if f"policy/{name}/version" in r]
        assert versions == list(range(1, STEPS + 1)), (name, versions)
        joint = {r.get(f"policy/{name}/train/joint") for r in rows if f"policy/{name}/version" in r}
        assert joint == ({1.0} if order == "together" else {None}), joint
        weights = load_weights(os.path.join(run_dir, "checkpoints", f"final-{name}"))
        moved = max(float(t.abs().max()) for k, t in weights.items() if "lora_B" in k)
        assert moved > 0, f"{name}'s adapter did not change"
