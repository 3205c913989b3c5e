"""``InferenceEngineContract``: the suite for inference backends (kind
``inference_engine``, ``areal_kernel.api.inference_engine``), run against a
client of your backend's running servers."""

from __future__ import annotations

import asyncio
from typing import Any


class InferenceEngineContract:
    """Fixtures: ``inference_engine`` (an ``InferenceEngine`` connected to
    running servers of your backend, weight version 0, serving the model in
    ``contract_model_dir``), ``contract_model_dir`` (an HF directory) and
    ``contract_alt_model_dir`` (the same architecture with different weights).
    Prompts use token ids below 256. Override ``generations_running``; set
    ``WEIGHT_FINGERPRINTS = False`` when your servers cannot fingerprint the
    weights they serve (``weight_fingerprints`` raises ``NotImplementedError``
    and the weight-delivery check is skipped with a note)."""

    PROMPT = [5, 6, 7, 8]
    # Tokens of the generation the pause test interrupts: long enough that the
    # few milliseconds between seeing it run and the pause landing cannot finish it.
    LONG_GENERATION = 400
    WEIGHT_FINGERPRINTS = True

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

    @staticmethod
    def _serve(engine: Any, version: int, path: str) -> None:
        """Serve the weights in ``path`` under ``version``, the way the trainer
        does: pause, update from disk, resume."""
        from areal_kernel.api.engine import WeightUpdateMeta

        engine.pause()
        engine.update_weights(WeightUpdateMeta(kind="disk", version=version, path=path))
        engine.resume()

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
        base = self._gen(inference_engine, [self.PROMPT], max_new_tokens=8, greedy=True)[0]
        v = inference_engine.get_version()
        self._serve(inference_engine, v + 1, contract_alt_model_dir)
        alt = self._gen(inference_engine, [self.PROMPT], max_new_tokens=8, greedy=True)[0]
        assert inference_engine.get_version() == v + 1
        assert set(alt.output_versions) == {v + 1}
        assert alt.output_logprobs != base.output_logprobs
        self._serve(inference_engine, v + 2, contract_model_dir)
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

    def test_weight_delivery_check_reads_the_served_weights(
        self, inference_engine: Any, contract_model_dir: str, contract_alt_model_dir: str
    ) -> None:
        """The weight-delivery check (``monitor.weights``) through this
        backend, every tensor at once: the servers' fingerprints match the
        weights they serve (``contract_model_dir``) and do not match the
        other directory's (the negative control). A tensor a server holds in
        a form it cannot read back is listed ``unreadable`` and left out; at
        least one must be readable."""
        from areal_kernel.monitor.weights import NamedWeights, WeightsMonitor, plan

        # Served by every server under one known version, whatever ran before.
        version = inference_engine.get_version() + 1
        self._serve(inference_engine, version, contract_model_dir)
        served = NamedWeights.from_dir(contract_model_dir)
        if not self.WEIGHT_FINGERPRINTS:
            spec = plan([(n, t.numel()) for n, t in served.named_weights_for_transfer()], version, 4, 4)
            try:
                inference_engine.weight_fingerprints(spec.to_json())
            except NotImplementedError:
                return
            raise AssertionError("WEIGHT_FINGERPRINTS is False, but weight_fingerprints answered")

        def check(weights: NamedWeights) -> tuple[dict[str, float], list[str]]:
            said: list[str] = []
            mon = WeightsMonitor(action="warn", tensors_per_update=10**6, elements_per_tensor=16, warn=said.append)
            out = mon.check(version, weights, inference_engine)
            assert out, f"the check was skipped: {said}"
            # A server that cannot read a tensor says so once, then the check samples the rest.
            if mon.unreadable:
                out = mon.check(version, weights, inference_engine)
            return out, said

        out, said = check(served)
        assert out["weights_servers"] == len(inference_engine.servers), f"{out}: " + "\n".join(said)
        assert out["weights_checked"] > 0 and out["weights_mismatch"] == 0, f"{out}: " + "\n".join(said)
        other, said = check(NamedWeights.from_dir(contract_alt_model_dir))
        assert other["weights_mismatch"] > 0, ("the check did not tell other weights from the served ones", other)

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
