"""Contract test suites that backend plugins subclass.

Usage in a plugin's tests::

    from areal_kernel.testing.contracts import PlatformContract

    class TestMyPlatform(PlatformContract):
        @pytest.fixture
        def platform(self):
            return MyPlatform()

Each contract asks for one fixture (named in its docstring) and checks what
the kernel relies on. They only use public kernel APIs.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor

if TYPE_CHECKING:
    from areal_kernel.api.engine import TrainEngine


class PlatformContract:
    """Fixture: ``platform`` (a ``Platform`` instance usable in this process)."""

    def test_identity(self, platform: Any) -> None:
        from areal_kernel.platforms import Platform

        assert isinstance(platform, Platform)
        assert platform.name and platform.name != "base"
        assert platform.device_type
        assert platform.dist_backend in {"gloo", "nccl", "hccl", "mpi", "xccl", "cncl"} or platform.dist_backend

    def test_visible_devices_env(self, platform: Any) -> None:
        env = platform.visible_devices_env_for([0, 1])
        assert isinstance(env, dict)
        if platform.visible_devices_env:
            assert env == {platform.visible_devices_env: "0,1"}
        else:
            assert env == {}

    def test_describe_is_complete(self, platform: Any) -> None:
        d = platform.describe()
        for key in ("name", "device_type", "dist_backend", "visible_devices_env", "ray_resource_name", "device_count"):
            assert key in d
        assert d["device_count"] >= 1

    def test_device_and_helpers(self, platform: Any) -> None:
        import torch

        dev = platform.device()
        t = torch.ones(3, device=dev)
        platform.synchronize()
        assert float(t.sum()) == 3.0
        assert platform.memory_allocated() >= 0
        platform.empty_cache()
        platform.manual_seed(0)
        a = torch.rand(4)
        platform.manual_seed(0)
        assert torch.equal(a, torch.rand(4))


class RewardContract:
    """Fixtures: ``reward_target`` (``"pkg.mod:fn"``, registered with
    ``areal_register_rewards``) and ``reward_cases`` (a list of
    ``(completion, answer, expected_score)`` covering a right and a wrong
    answer); optionally ``reward_settings``, your ``reward.<name>`` section as
    a user writes it (default ``{}``). The suite validates it through your
    registered ``config_model`` and builds the reward as the kernel does
    (``Registry.build("reward", ...)``: every field, defaults included, as
    JSON data; the pool loads your ``worker_preload``), so the config
    model's defaults are the ones your reward receives."""

    @pytest.fixture
    def reward_settings(self) -> dict[str, Any]:
        return {}

    def _reward(self, reward_target: str, reward_settings: dict[str, Any]) -> Any:
        """The reward as the kernel builds it (``Registry.build("reward", ...)``
        with ``reward_settings`` validated like a ``reward.<name>`` section):
        ``fn`` and the keywords it receives, ``settings``."""
        from areal_kernel.api.reward import RewardContext
        from areal_kernel.config.sections import validate_settings
        from areal_kernel.plugins import get_registry

        reg = get_registry()
        specs = [s for s in reg.specs("reward") if s.target == reward_target]
        assert specs, (
            f"no reward is registered with target {reward_target!r}: the kernel only calls rewards registered "
            "with areal_register_rewards (is the plugin installed in the test process?)"
        )
        name = specs[0].name
        settings = validate_settings(f"reward.{name}", "reward", name, reward_settings, spec=specs[0])
        return reg.build("reward", name, RewardContext(name, settings))

    def test_scores_cases(
        self, reward_target: str, reward_cases: list[tuple[str, str, float]], reward_settings: dict[str, Any]
    ) -> None:
        reward = self._reward(reward_target, reward_settings)
        fn, kwargs = reward.fn, reward.settings
        assert len({exp for _, _, exp in reward_cases}) >= 2, "give at least one right and one wrong case"
        for completion, answer, expected in reward_cases:
            score = fn(completion, answer, **kwargs)
            assert isinstance(score, float), f"reward returned {type(score).__name__}, expected float"
            assert score == pytest.approx(expected), (completion, answer)

    def test_empty_completion_does_not_raise(
        self, reward_target: str, reward_cases: list[tuple[str, str, float]], reward_settings: dict[str, Any]
    ) -> None:
        reward = self._reward(reward_target, reward_settings)
        assert isinstance(reward.fn("", reward_cases[0][1], **reward.settings), float)

    def test_runs_in_the_kernel_reward_pool(
        self, reward_target: str, reward_cases: list[tuple[str, str, float]], reward_settings: dict[str, Any]
    ) -> None:
        from areal_kernel.reward.pool import RewardPool

        # Bound the way the trainer binds reward.<name> (make_reward_pool): the settings cross into the worker as JSON.
        reward = self._reward(reward_target, reward_settings)
        pool = RewardPool(
            n_workers=1, timeout_s=60, preload=reward.worker_preload, settings={reward.target: dict(reward.settings)}
        )
        try:
            completion, answer, expected = reward_cases[0]
            result = asyncio.run(pool.ascore(reward_target, completion, answer))
            assert result.ok, result.error
            assert result.score == pytest.approx(expected)
        finally:
            pool.close()


class InferenceEngineContract:
    """Fixtures: ``inference_engine`` (an ``InferenceEngine`` connected to
    running servers of your backend, weight version 0, serving the model in
    ``contract_model_dir``), ``contract_model_dir`` (an HF directory) and
    ``contract_alt_model_dir`` (the same architecture with different weights).
    Prompts use token ids below 256. Override ``generations_running``."""

    PROMPT = [5, 6, 7, 8]
    # Tokens of the generation the pause test interrupts: long enough that the
    # few milliseconds between seeing it run and the pause landing cannot finish it.
    LONG_GENERATION = 400

    def _gen(self, engine: Any, prompts: list[list[int]], **g: Any) -> list[Any]:
        from areal_kernel.api.io import GenerationConfig, ModelRequest

        async def go() -> list[Any]:
            try:
                return await asyncio.gather(
                    *(engine.agenerate(ModelRequest(p, GenerationConfig(**g))) for p in prompts)
                )
            finally:
                close = getattr(engine, "aclose", None)
                if close is not None:
                    await close(current_loop_only=True)

        return asyncio.run(go())

    def test_generation_carries_aligned_logprobs_and_versions(self, inference_engine: Any) -> None:
        (r,) = self._gen(inference_engine, [self.PROMPT], max_new_tokens=8, greedy=True)
        assert 1 <= r.output_len <= 8
        assert len(r.output_logprobs) == len(r.output_versions) == r.output_len
        assert all(lp <= 1e-6 for lp in r.output_logprobs)
        assert set(r.output_versions) == {inference_engine.get_version()}
        assert r.input_ids == self.PROMPT

    def test_greedy_is_deterministic_under_concurrency(self, inference_engine: Any) -> None:
        prompts = [self.PROMPT, [9, 10], [11, 12, 13], self.PROMPT]
        a = self._gen(inference_engine, prompts, max_new_tokens=6, greedy=True)
        b = self._gen(inference_engine, prompts[::-1], max_new_tokens=6, greedy=True)[::-1]
        assert [r.output_ids for r in a] == [r.output_ids for r in b]
        assert a[0].output_ids == a[3].output_ids

    def test_weight_update_from_disk_changes_and_restores_outputs(
        self, inference_engine: Any, contract_model_dir: str, contract_alt_model_dir: str
    ) -> None:
        from areal_kernel.api.engine import WeightUpdateMeta

        base = self._gen(inference_engine, [self.PROMPT], max_new_tokens=8, greedy=True)[0]
        v = inference_engine.get_version()
        inference_engine.pause()
        inference_engine.update_weights(WeightUpdateMeta(kind="disk", version=v + 1, path=contract_alt_model_dir))
        inference_engine.resume()
        alt = self._gen(inference_engine, [self.PROMPT], max_new_tokens=8, greedy=True)[0]
        assert inference_engine.get_version() == v + 1
        assert set(alt.output_versions) == {v + 1}
        assert alt.output_logprobs != base.output_logprobs
        inference_engine.pause()
        inference_engine.update_weights(WeightUpdateMeta(kind="disk", version=v + 2, path=contract_model_dir))
        inference_engine.resume()
        again = self._gen(inference_engine, [self.PROMPT], max_new_tokens=8, greedy=True)[0]
        assert again.output_ids == base.output_ids
        assert max(abs(x - y) for x, y in zip(again.output_logprobs, base.output_logprobs)) < 1e-4

    def test_control_operations_reach_every_server(self, inference_engine: Any) -> None:
        """Backends extend the kernel's client through public control
        operations (``HttpCall`` sequences), never its private methods."""
        from areal_kernel.inference.client import RemoteInferenceEngine
        from areal_kernel.inference.wire import HttpCall

        assert isinstance(inference_engine, RemoteInferenceEngine), (
            "make_client must return the kernel's RemoteInferenceEngine (or a subclass)"
        )
        health = HttpCall("GET", inference_engine.protocol.health_path)
        replies = inference_engine.control_all(health, require_all=True)
        assert len(replies) == len(inference_engine.servers)
        # A sequence runs in order on one server; its result is the last reply.
        first = inference_engine.servers[0].address
        assert inference_engine.control(first, [health, health]) == replies[0]
        per = inference_engine.protocol.ranks_per_server
        assert inference_engine.weight_group_world_size == 1 + per * len(inference_engine.servers)

    def generations_running(self, engine: Any) -> int:
        """How many generations the servers behind ``engine`` are running now.

        Override it with what your servers report (a status route, metrics):
        the pause test waits on it, because a sleep is a guess that a fast CPU
        beats by finishing the whole generation first."""
        raise NotImplementedError(
            f"{type(self).__name__} must override generations_running(engine) -> int "
            "(requests your servers are generating right now), used to pause mid-generation"
        )

    def test_pause_interrupts_and_resume_completes(self, inference_engine: Any) -> None:
        import threading

        from areal_kernel.testing.waits import wait_until

        box: dict[str, Any] = {}
        n = self.LONG_GENERATION

        def worker() -> None:
            (box["r"],) = self._gen(inference_engine, [self.PROMPT], max_new_tokens=n, greedy=True, stop_token_ids=[])

        t = threading.Thread(target=worker)
        t.start()
        try:
            wait_until(
                lambda: self.generations_running(inference_engine) >= 1,
                timeout_s=120,
                what="the generation to start on a server",
            )
        finally:
            inference_engine.pause()
        # Not a synchronisation: a paused generation waits however long we look.
        t.join(0.5)
        assert t.is_alive(), "a paused generation must wait, not finish"
        inference_engine.resume()
        t.join(300)
        r = box["r"]
        assert r.n_interruptions >= 1
        assert len(r.output_ids) == len(r.output_logprobs) == len(r.output_versions)


class TrainEngineContract:
    """Fixtures: ``train_engine`` (an initialized ``TrainEngine`` on
    ``contract_model_dir``, lr about 1e-3), ``contract_model_dir`` (a small HF
    causal LM with token ids below 256) and ``make_train_engine``: a callable
    ``make_train_engine(model_dir=None)`` returning a *new* initialized engine
    with ``train_engine``'s settings, on ``model_dir`` (default
    ``contract_model_dir``); the contract destroys the engines it makes.

    Checks what the trainer relies on: aligned logprobs, a step in the
    advantage direction, the HF export, the weight list of the broadcast
    transport, and exact recovery through ``save_state``/``load_state``.

    The engine's logprobs against transformers on its own HF export are a
    comparison across code paths: within ``EXPORT_NOISE_MULTIPLE`` x the
    export's sdpa-vs-eager difference (``areal_kernel.testing.noise``)."""

    # Measured: the torch engine 0.2x, 2 FSDP ranks 0.1-0.4x (AVX-512 and avx2);
    # 8x leaves room for an engine with kernels of its own (Megatron) while a
    # wrong or missing weight in the export is off by > 1e-2.
    EXPORT_NOISE_MULTIPLE = 8.0

    def _batch(self, seed: int = 0) -> Any:
        import random

        from areal_kernel.api.io import Trajectory, TrajectoryBatch

        if seed == 0:
            seqs = [[1, 5, 9, 3, 7], [2, 4, 6], [8, 8, 1, 2, 3, 4, 5], [3, 1]]
        else:
            rng = random.Random(seed)
            seqs = [[rng.randrange(3, 256) for _ in range(n)] for n in (7, 4, 9, 5)]
        trajs = []
        for i, ids in enumerate(seqs):
            mask = [0] + [1] * (len(ids) - 1)
            trajs.append(
                Trajectory(
                    ids,
                    mask,
                    [0.0] + [-1.0] * (len(ids) - 1),
                    [-1] + [0] * (len(ids) - 1),
                    reward=float(i % 2),
                    group_id="g",
                )
            )
        return TrajectoryBatch(trajs)

    @staticmethod
    def _ppo_inputs(batch: Any, engine: TrainEngine) -> dict[str, list[list[float]]]:
        adv = [[(1.0 if t.reward > 0 else -1.0) * m for m in t.loss_mask] for t in batch.trajectories]
        return {"advantages": adv, "prox_logprobs": engine.compute_logprobs(batch)}

    @staticmethod
    def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
        return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))

    def test_logprobs_are_aligned_and_finite(self, train_engine: TrainEngine) -> None:
        import math

        batch = self._batch()
        lps = train_engine.compute_logprobs(batch)
        assert [len(x) for x in lps] == [len(t.input_ids) for t in batch.trajectories]
        for row in lps:
            assert row[0] == 0.0
            assert all(math.isfinite(x) and x <= 1e-6 for x in row)

    def test_train_step_changes_logprobs_in_the_advantage_direction(self, train_engine: TrainEngine) -> None:
        from areal_kernel.algo.losses import make_ppo_loss_fn

        batch = self._batch()
        extra = self._ppo_inputs(batch, train_engine)
        before = extra["prox_logprobs"]
        stats = train_engine.train_batch(batch, make_ppo_loss_fn(eps_clip=0.2), extra)
        assert stats["skipped"] == 0.0 and stats["grad_norm"] > 0
        after = train_engine.compute_logprobs(batch)
        up = sum(
            a - b
            for t, ra, rb in zip(batch.trajectories, after, before)
            if t.reward > 0
            for a, b in zip(ra[1:], rb[1:])
        )
        down = sum(
            a - b
            for t, ra, rb in zip(batch.trajectories, after, before)
            if t.reward == 0
            for a, b in zip(ra[1:], rb[1:])
        )
        assert up > 0 > down

    def test_save_hf_round_trips(self, train_engine: TrainEngine, tmp_path: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        out = str(tmp_path / "hf")
        train_engine.save_hf(out)
        batch = self._batch()
        mine = train_engine.compute_logprobs(batch)
        ids = batch.trajectories[0].input_ids
        refs = []
        # The export through transformers, with sdpa and with eager attention:
        # their difference is the noise floor of this cross-path comparison.
        for attn in ("sdpa", "eager"):
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation=attn)
            with torch.no_grad():
                logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            refs.append([0.0] + [logp[i - 1, ids[i]].item() for i in range(1, len(ids))])
        floor = measure_noise_floor("logprobs of the export", refs[0], refs[1])
        print(assert_within_noise(mine[0], refs[0], floor, self.EXPORT_NOISE_MULTIPLE, what="engine vs its HF export"))

    def test_transfer_weights_are_what_the_export_holds(self, train_engine: TrainEngine, tmp_path: Any) -> None:
        """``named_weights_for_transfer`` (what the broadcast transport sends)
        names exactly the tensors of the HF export, with their shapes and
        dtypes, and nothing a model needs is missing (tied aliases aside)."""
        import glob
        import os

        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        from areal_kernel.api.engine import WeightUpdateMeta

        named = train_engine.named_weights_for_transfer()
        names = [n for n, _ in named]
        assert names and len(set(names)) == len(names)
        out = str(tmp_path / "w")
        train_engine.send_weights(WeightUpdateMeta(kind="disk", version=1, path=out))
        files: dict[str, Any] = {}
        for f in glob.glob(os.path.join(out, "*.safetensors")):
            files.update(load_file(f))
        assert set(files) == set(names)
        for n, t in named:
            assert tuple(files[n].shape) == tuple(t.shape) and files[n].dtype == t.dtype, n
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        ptrs = {t.data_ptr() for n, t in model.state_dict().items() if n in files}
        # Every model weight not in the list shares storage with one in it (a tied alias).
        assert all(t.data_ptr() in ptrs for n, t in model.state_dict().items() if n not in files)

    def test_save_state_then_load_state_continues_identically(
        self, train_engine: TrainEngine, make_train_engine: Any, tmp_path: Any
    ) -> None:
        """Exact recovery: a new engine that loads a checkpoint takes the same
        next step (loss, grad norm, lr) and ends with the same logprobs as the
        engine that wrote it; the version travels with the state."""
        from areal_kernel.algo.losses import make_ppo_loss_fn

        loss = make_ppo_loss_fn(eps_clip=0.2)
        first, nxt, probe = self._batch(1), self._batch(2), self._batch(3)
        train_engine.train_batch(first, loss, self._ppo_inputs(first, train_engine))  # optimizer moments exist
        train_engine.set_version(5)
        ckpt = str(tmp_path / "state")
        train_engine.save_state(ckpt)
        saved_lp = train_engine.compute_logprobs(probe)
        a = train_engine.train_batch(nxt, loss, self._ppo_inputs(nxt, train_engine))
        a_lp = train_engine.compute_logprobs(probe)

        fresh: TrainEngine = make_train_engine()
        try:
            # Control: the fresh engine starts elsewhere, so matching below means loading worked.
            assert self._max_diff(fresh.compute_logprobs(probe), saved_lp) > 1e-6
            fresh.load_state(ckpt)
            assert fresh.get_version() == 5
            assert self._max_diff(fresh.compute_logprobs(probe), saved_lp) < 1e-6
            b = fresh.train_batch(nxt, loss, self._ppo_inputs(nxt, fresh))
            b_lp = fresh.compute_logprobs(probe)
        finally:
            fresh.destroy()
        for k in ("loss", "grad_norm", "lr"):
            assert abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(a[k])), (k, a[k], b[k])
        assert self._max_diff(a_lp, b_lp) < 1e-6

    def test_load_state_names_a_wrong_directory(self, train_engine: TrainEngine, tmp_path: Any) -> None:
        from areal_kernel.errors import DataError

        with pytest.raises(DataError) as e:
            train_engine.load_state(str(tmp_path))
        assert str(tmp_path) in str(e.value)
