"""``WeightTransportContract``: the suite for weight transports (kind
``weight_transport``, ``areal_kernel.api.weight_transport``), from the
kernel's torch engine to its embedded server."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable

import pytest

from areal_kernel.testing.contracts._shared import _build, _closing, _embedded_engine, _finite, _torch_engine


class WeightTransportContract:
    """Fixture: ``transport_name`` (a registered weight transport; class-scoped).
    Optional, all class-scoped: ``transport_model_dir`` (default the
    session's tiny Llama), ``transport_train_engine`` (default the kernel's
    torch engine on it) and ``transport_inference_engine`` (default the
    kernel's embedded server on it, fp32). Override ``change_weights`` if
    your train engine's ``named_weights_for_transfer()`` are not live views."""

    PROMPT = [5, 6, 7, 8]
    NEW_TOKENS = 8
    LOGPROB_ATOL = 1e-3
    BUCKET_BYTES = 64 << 10  # several buckets for the tiny model

    @pytest.fixture(scope="class")
    @classmethod
    def transport_model_dir(cls, areal_tiny_model_dir: str) -> str:
        return areal_tiny_model_dir

    @pytest.fixture(scope="class")
    @classmethod
    def transport_train_engine(cls, transport_model_dir: str) -> Any:
        engine = _torch_engine(transport_model_dir, total_steps=4)
        yield engine
        engine.destroy()

    @pytest.fixture(scope="class")
    @classmethod
    def transport_inference_engine(cls, transport_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
        launcher, engine = _embedded_engine(transport_model_dir, str(tmp_path_factory.mktemp("transport-server")))
        yield engine
        engine.destroy()
        launcher.stop()

    @pytest.fixture(scope="class")
    @classmethod
    def transport_runs_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        return str(tmp_path_factory.mktemp("transport-runs"))

    @pytest.fixture(scope="class")
    @classmethod
    def transport(
        cls, transport_name: str, transport_train_engine: Any, transport_inference_engine: Any, transport_runs_dir: str
    ) -> Any:
        """Built and set up as the trainer does, on the run directory ``<runs>/exp``."""
        run_dir = os.path.join(transport_runs_dir, "exp")
        os.makedirs(run_dir)
        from areal_kernel.api.weight_transport import WeightTransportContext

        t = _build("weight_transport", transport_name, WeightTransportContext(
            name=transport_name, train_engine=transport_train_engine,
            inference_engine=transport_inference_engine, run_dir=run_dir, bucket_bytes=cls.BUCKET_BYTES,
        ))  # fmt: skip
        t.setup()
        yield t
        close = getattr(t, "close", None)
        if close is not None:
            close()

    def change_weights(self, train_engine: Any) -> Callable[[], None]:
        """Change the train engine's weights in place; return what restores them."""
        import torch

        named = list(train_engine.named_weights_for_transfer())
        saved = [t.detach().clone() for _, t in named]
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for _, t in named:
                if t.is_floating_point():
                    t.add_(0.2 * torch.randn(t.shape, generator=g).to(t.dtype))

        def restore() -> None:
            with torch.no_grad():
                for (_, t), s in zip(named, saved):
                    t.copy_(s)

        return restore

    def _served(self, infer: Any) -> Any:
        from areal_kernel.api.io import GenerationConfig, ModelRequest

        req = ModelRequest(
            list(self.PROMPT), GenerationConfig(max_new_tokens=self.NEW_TOKENS, greedy=True, stop_token_ids=[])
        )
        return asyncio.run(_closing(infer, infer.agenerate(req)))

    def _assert_serves_the_trainer(self, train: Any, resp: Any) -> None:
        from areal_kernel.api.io import Trajectory, TrajectoryBatch

        ids = list(resp.input_ids) + list(resp.output_ids)
        n = len(resp.input_ids)
        traj = Trajectory(ids, [0] * n + [1] * resp.output_len, [0.0] * len(ids), [-1] * len(ids), reward=0.0)
        mine = train.compute_logprobs(TrajectoryBatch([traj]))[0][n:]
        diff = max(abs(a - b) for a, b in zip(mine, resp.output_logprobs))
        assert diff < self.LOGPROB_ATOL, f"served logprobs differ from the train engine's by {diff}"

    def test_has_a_name(self, transport: Any) -> None:
        # Reported to areal_on_weight_update observers.
        assert isinstance(transport.name, str) and transport.name

    def test_updates_serve_the_trainer_weights_under_the_new_version(
        self, transport: Any, transport_train_engine: Any, transport_inference_engine: Any, transport_runs_dir: str
    ) -> None:
        train, infer = transport_train_engine, transport_inference_engine
        base = self._served(infer)
        self._assert_serves_the_trainer(train, base)
        v = infer.get_version()
        restore = self.change_weights(train)
        try:
            metrics = transport.update(v + 1)
            assert isinstance(metrics, dict) and all(isinstance(k, str) and _finite(x) for k, x in metrics.items()), (
                metrics
            )
            changed = self._served(infer)
            assert infer.get_version() == v + 1 and set(changed.output_versions) == {v + 1}
            assert changed.output_logprobs != base.output_logprobs, "the new weights changed nothing on the servers"
            self._assert_serves_the_trainer(train, changed)
        finally:
            restore()
        transport.update(v + 2)
        back = self._served(infer)
        assert infer.get_version() == v + 2 and set(back.output_versions) == {v + 2}
        assert back.output_ids == base.output_ids
        self._assert_serves_the_trainer(train, back)
        # Whatever the transport wrote lies in the run directory.
        assert os.listdir(transport_runs_dir) == ["exp"], os.listdir(transport_runs_dir)
