"""vLLM worker extension (``--worker-extension-cls areal_vllm.worker_ext.AReaLWorkerExtension``).

vLLM imports this module in every worker process before it builds the
worker, so registering our weight-transfer engine here (through vLLM's public
factory, lazily by module path) makes ``--weight-transfer-config
'{"backend": "areal"}'`` resolve when the model is loaded. Nothing of vLLM is
patched.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from areal_vllm.transfer import ENGINE_NAME

if ENGINE_NAME not in WeightTransferEngineFactory._registry:
    # (_registry is read only to stay idempotent: register_engine raises on a
    # second registration, and the module may be imported more than once.)
    WeightTransferEngineFactory.register_engine(ENGINE_NAME, "areal_vllm.transfer", "AReaLWeightTransferEngine")


class AReaLWorkerExtension:
    """Mixed into vLLM's worker class; its methods are callable through
    ``POST /collective_rpc``. Names are prefixed to avoid clashing with the worker's."""

    def areal_refresh_after_reload(self) -> int:
        """After ``reload_weights``: rebuild what vLLM's CPU kernels keep
        prepacked and a reload leaves stale (a tied LM head, MoE experts; see
        ``transfer.refresh_after_reload``)."""
        from areal_vllm.transfer import is_tied, refresh_after_reload

        runner: Any = getattr(self, "model_runner")
        return refresh_after_reload(runner.get_model(), is_tied(getattr(self, "vllm_config").model_config))

    def areal_transfer_engine_name(self) -> str | None:
        """Which weight-transfer engine this worker built (a health check for tests)."""
        engine: Any = getattr(self, "weight_transfer_engine", None)
        return type(engine).__name__ if engine is not None else None

    def areal_weight_fingerprint(self, spec_json: str) -> dict[str, Any]:
        """The weight-delivery check (``monitor.weights``) over the weights this
        worker loaded; ``spec_json``: ``FingerprintSpec.to_json()`` as JSON text
        (vLLM's ``/collective_rpc`` passes string arguments). See
        ``areal_vllm.fingerprint``."""
        from areal_vllm.fingerprint import worker_fingerprint
        from areal_vllm.transfer import is_tied

        runner: Any = getattr(self, "model_runner")
        model_config = getattr(self, "vllm_config").model_config
        hf = model_config.hf_config
        text = getattr(hf, "get_text_config", lambda: hf)()
        return worker_fingerprint(runner.get_model(), text, is_tied(model_config), spec_json)

    def areal_adapter_fingerprints(self, spec_json: str) -> dict[str, Any]:
        """The weight-delivery check over the LoRA adapters this worker holds
        (every one, keyed by vLLM's adapter id: workers do not know adapter
        names); see ``areal_vllm.fingerprint.worker_adapter_fingerprints``."""
        from areal_vllm.fingerprint import worker_adapter_fingerprints

        runner: Any = getattr(self, "model_runner")
        return worker_adapter_fingerprints(getattr(runner, "lora_manager", None), spec_json)
