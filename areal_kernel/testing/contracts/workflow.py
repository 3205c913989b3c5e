"""``WorkflowContract``: the suite for rollout workflows (kind ``workflow``,
``areal_kernel.api.workflow``), on the kernel's embedded server and reward
workers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from areal_kernel.testing.contracts._shared import (
    _build,
    _check_unknown_setting_is_refused,
    _closing,
    _config,
    _embedded_engine,
    _finite,
    _section,
    _spec,
)
from areal_kernel.testing.recording import RecordingEngine, loss_spans


def _responses_text(tokenizer: Any, trajectory: Any) -> list[str]:
    """Each run of loss tokens of ``trajectory`` (one engine response) decoded
    with special tokens skipped."""
    ids = trajectory.input_ids
    return [tokenizer.decode(ids[i:j], skip_special_tokens=True) for i, j in loss_spans(trajectory.loss_mask)]


class WorkflowContract:
    """Fixture: ``workflow_name`` (your ``workflow.type``). Optional:
    ``workflow_settings`` (your ``workflow.<name>`` section, default
    ``{}``), ``workflow_record`` (a record with your ``required_fields``,
    default a ``prompt``/``answer`` question), ``workflow_model_dir``
    (class-scoped; default the session's tiny chat Llama) and
    ``workflow_engine`` (class-scoped; default the kernel's embedded server
    on that model). The reward is ``areal_kernel.testing.probe_reward``, run
    in the kernel's reward workers. Override ``expected_completion`` if your
    reward sees something else than the decoded generated tokens (or one
    response of them).

    A trajectory's reward must come from reward calls on its own generated
    text, combined as the workflow likes (``multi_turn`` discounts a retry),
    within ``[min(0, scores), max(0, scores)]`` of those calls."""

    N_SAMPLES = 3
    MAX_NEW_TOKENS = 6

    @pytest.fixture
    def workflow_settings(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def workflow_record(self) -> dict[str, Any]:
        return {"id": "contract-q1", "prompt": "What is 2 + 3?", "answer": "5"}

    @pytest.fixture(scope="class")
    @classmethod
    def workflow_model_dir(cls, areal_tiny_chat_model_dir: str) -> str:
        return areal_tiny_chat_model_dir

    @pytest.fixture(scope="class")
    @classmethod
    def workflow_engine(cls, workflow_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
        launcher, engine = _embedded_engine(workflow_model_dir, str(tmp_path_factory.mktemp("workflow-server")))
        yield engine
        engine.destroy()
        launcher.stop()

    def expected_completion(self, tokenizer: Any, trajectory: Any) -> str:
        """What the reward must receive for ``trajectory``: its generated
        tokens decoded with special tokens skipped (docs: Rewards)."""
        return tokenizer.decode(
            [t for t, m in zip(trajectory.input_ids, trajectory.loss_mask) if m], skip_special_tokens=True
        )

    def _build(
        self, name: str, settings: dict, model_dir: str, log_path: str, fail: bool = False
    ) -> tuple[Any, Any, Any]:
        """The workflow as ``Rollout.start`` builds it, rewarded by the probe."""
        from areal_kernel.reward.pool import RewardPool
        from areal_kernel.testing.probe_reward import PROBE_REWARD_TARGET
        from areal_kernel.trainer.components import generation_config, load_tokenizer

        cfg = _config({
            "workflow": _section(name, settings, type=name),
            "rollout": {"gconfig": {"n_samples": self.N_SAMPLES, "max_new_tokens": self.MAX_NEW_TOKENS}},
        })  # fmt: skip
        tokenizer = load_tokenizer(model_dir)
        pool = RewardPool(n_workers=1, timeout_s=60, preload=(),
                          settings={PROBE_REWARD_TARGET: {"log_path": log_path, "fail": fail}})  # fmt: skip
        from areal_kernel.api.reward import Reward
        from areal_kernel.api.workflow import WorkflowContext
        from areal_kernel.testing import probe_reward

        reward = Reward(
            name="probe",
            target=PROBE_REWARD_TARGET,
            plugin="areal_kernel.testing",
            fn=probe_reward.probe_reward,
            settings={"log_path": log_path, "fail": fail},
        )
        workflow = _build("workflow", name, WorkflowContext(
            name=name, tokenizer=tokenizer, gconfig=generation_config(cfg), reward=reward, reward_pool=pool,
            settings=cfg.workflow.plugin_config, config=cfg,
        ))  # fmt: skip
        return workflow, pool, tokenizer

    def _episode(self, workflow: Any, engine: Any, record: dict) -> tuple[Any, RecordingEngine]:
        from areal_kernel.api.io import TrajectoryGroup

        rec = RecordingEngine(engine)
        group = asyncio.run(_closing(engine, workflow.arun_episode(rec, dict(record))))
        assert group is not None, "the workflow rejected the contract record; give a workflow_record it accepts"
        assert isinstance(group, TrajectoryGroup), f"arun_episode returned {type(group).__name__}"
        assert group.trajectories, "the group holds no trajectory"
        return group, rec

    def test_trains_on_exactly_what_the_engine_generated(
        self, workflow_name: str, workflow_settings: dict, workflow_record: dict, workflow_model_dir: str,
        workflow_engine: Any, tmp_path: Any,
    ) -> None:  # fmt: skip
        wf, pool, _ = self._build(workflow_name, workflow_settings, workflow_model_dir, str(tmp_path / "calls.jsonl"))
        try:
            group, rec = self._episode(wf, workflow_engine, workflow_record)
        finally:
            pool.close()
        # Advantages are normalised per group id: every sample carries the group's.
        assert group.group_id and {t.group_id for t in group.trajectories} == {group.group_id}
        for k, t in enumerate(group.trajectories):
            assert set(t.loss_mask) <= {0, 1} and t.loss_mask[0] == 0, f"trajectory {k}: loss_mask {t.loss_mask}"
            assert sum(t.loss_mask) >= 1, f"trajectory {k} has no loss token"
            assert _finite(t.reward), t.reward
            for i, m in enumerate(t.loss_mask):
                if not m:
                    assert t.logprobs[i] == 0.0 and t.versions[i] == -1, f"trajectory {k} token {i} off the mask"
            # Each run of loss tokens is one response, generated from exactly the tokens before it.
            for i, j in loss_spans(t.loss_mask):
                match = [
                    r
                    for q, r in rec.calls
                    if list(q.input_ids) == t.input_ids[:i] and list(r.output_ids) == t.input_ids[i:j]
                ]
                assert match, (
                    f"trajectory {k}: loss tokens {i}:{j} are no response of the engine to the tokens before them"
                )
                # Several calls can share their ids (samples of one prompt that
                # said the same thing) yet differ in the last bits of their
                # logprobs (computed in different batches): one must agree exactly.
                assert any(t.logprobs[i:j] == list(r.output_logprobs) for r in match), (
                    f"trajectory {k}: logprobs {t.logprobs[i:j]} are none of the engine's "
                    f"{[list(r.output_logprobs) for r in match]}"
                )
                assert any(t.versions[i:j] == list(r.output_versions) for r in match), (
                    f"trajectory {k}: versions differ from the engine's"
                )

    def test_rewards_are_called_as_documented(
        self, workflow_name: str, workflow_settings: dict, workflow_record: dict, workflow_model_dir: str,
        workflow_engine: Any, tmp_path: Any,
    ) -> None:  # fmt: skip
        from areal_kernel.testing.probe_reward import read_probe_calls

        log_path = str(tmp_path / "calls.jsonl")
        wf, pool, tok = self._build(workflow_name, workflow_settings, workflow_model_dir, log_path)
        try:
            group, _ = self._episode(wf, workflow_engine, workflow_record)
        finally:
            pool.close()
        calls = read_probe_calls(log_path)
        assert calls, "the reward was never called"
        assert all(c["answer"] == str(workflow_record["answer"]) for c in calls), calls
        for k, t in enumerate(group.trajectories):
            # The rule (docs: Workflows): a trajectory's reward comes from the
            # reward calls made on its own generated text (all of it, or one
            # response of it), combined as the workflow likes (a discounted
            # retry is fine) but never outside [min(0, scores), max(0, scores)].
            texts = {self.expected_completion(tok, t)} | set(_responses_text(tok, t))
            scores = [c["score"] for c in calls if c["completion"] in texts]
            assert scores, f"trajectory {k}: no reward call on its generated text {sorted(texts)}; calls {calls}"
            assert min(0.0, *scores) <= t.reward <= max(0.0, *scores), (
                f"trajectory {k}: reward {t.reward} is outside the scores of its reward calls {scores} (and 0)"
            )
        assert (getattr(wf, "reward_calls", None), getattr(wf, "reward_failures", None)) == (len(calls), 0)

    def test_failed_reward_calls_are_counted(
        self, workflow_name: str, workflow_settings: dict, workflow_record: dict, workflow_model_dir: str,
        workflow_engine: Any, tmp_path: Any,
    ) -> None:  # fmt: skip
        """The trainer stops a run when too many reward calls fail: it reads
        ``reward_calls``, ``reward_failures`` and ``last_reward_error``."""
        from areal_kernel.testing.probe_reward import PROBE_FAILURE, read_probe_calls

        log_path = str(tmp_path / "calls.jsonl")
        wf, pool, _ = self._build(workflow_name, workflow_settings, workflow_model_dir, log_path, fail=True)
        try:
            group, _ = self._episode(wf, workflow_engine, workflow_record)
        finally:
            pool.close()
        n = len(read_probe_calls(log_path))
        assert n >= 1
        assert (wf.reward_calls, wf.reward_failures) == (n, n)
        assert PROBE_FAILURE in (wf.last_reward_error or ""), wf.last_reward_error
        assert all(t.reward == 0.0 for t in group.trajectories), "a failed reward call must score 0"

    def test_same_sample_seed_same_samples(
        self, workflow_name: str, workflow_settings: dict, workflow_record: dict, workflow_model_dir: str,
        workflow_engine: Any, tmp_path: Any,
    ) -> None:  # fmt: skip
        """A resumed run regenerates the samples the killed run would have:
        records carry ``_sample_seed`` and the workflow seeds sampling from it."""
        wf, pool, _ = self._build(workflow_name, workflow_settings, workflow_model_dir, str(tmp_path / "calls.jsonl"))
        record = {**workflow_record, "_sample_seed": 1234, "_sample_uid": "e0-0"}
        try:
            a, _ = self._episode(wf, workflow_engine, record)
            b, _ = self._episode(wf, workflow_engine, record)
        finally:
            pool.close()
        assert [t.input_ids for t in a.trajectories] == [t.input_ids for t in b.trajectories]

    def test_evaluates_one_record_greedily(
        self, workflow_name: str, workflow_settings: dict, workflow_record: dict, workflow_model_dir: str,
        workflow_engine: Any, tmp_path: Any,
    ) -> None:  # fmt: skip
        """What the held-out evaluation calls: ``aevaluate(engine, record, max_new_tokens) -> (reward, text)``."""
        from areal_kernel.testing.probe_reward import probe_score, read_probe_calls

        log_path = str(tmp_path / "calls.jsonl")
        wf, pool, _ = self._build(workflow_name, workflow_settings, workflow_model_dir, log_path)
        try:
            score, text = asyncio.run(
                _closing(workflow_engine, wf.aevaluate(workflow_engine, dict(workflow_record), 4))
            )
            again = asyncio.run(_closing(workflow_engine, wf.aevaluate(workflow_engine, dict(workflow_record), 4)))
        finally:
            pool.close()
        assert isinstance(text, str) and isinstance(score, float)
        assert score == probe_score(text) and again == (score, text), "greedy evaluation must be repeatable"
        assert [c["completion"] for c in read_probe_calls(log_path)] == [text, text]

    def test_required_fields_are_declared(self, workflow_name: str, workflow_record: dict) -> None:
        # The kernel checks every dataset record for these before any server starts.
        fields = getattr(_spec("workflow", workflow_name).load(), "required_fields", ("prompt",))
        assert isinstance(fields, tuple) and all(isinstance(f, str) and f for f in fields), fields
        assert all(f in workflow_record for f in fields), (fields, sorted(workflow_record))

    def test_unknown_setting_is_refused(self, workflow_name: str) -> None:
        _check_unknown_setting_is_refused("workflow", workflow_name, f"workflow.{workflow_name}")
