"""The kernel's inference-engine contract against STAND-IN SGLang servers
(sglang_standin.py; no real SGLang runs here), launched through SGLangBackend
from a validated config, with every request checked by SGLang's own classes."""

from __future__ import annotations

import pytest

from areal_kernel.testing.contracts import InferenceEngineContract

from sglang_testutil import STANDIN_PREFIX, make_model_dir, standin_state

pytestmark = pytest.mark.slow


def _weights_dir(path, seed: int) -> str:
    """A stand-in model directory whose weight file is real safetensors, which
    the stand-in serves and fingerprints (the contract's weight-delivery
    case); another seed writes other bytes, hence other outputs."""
    import torch
    from safetensors.torch import save_file

    d = make_model_dir(path, seed)
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "model.embed_tokens.weight": torch.randn(256, 32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
    }
    save_file(tensors, f"{d}/model.safetensors")
    return d


@pytest.fixture(scope="module")
def contract_model_dir(tmp_path_factory):
    return _weights_dir(tmp_path_factory.mktemp("contract-a"), 1)


@pytest.fixture(scope="module")
def contract_alt_model_dir(tmp_path_factory):
    return _weights_dir(tmp_path_factory.mktemp("contract-b"), 2)


@pytest.fixture(scope="module")
def backend(contract_model_dir, oracle_url, tmp_path_factory):
    from areal_kernel.config import validate_config
    from areal_kernel.plugins import get_registry
    from areal_sglang.backend import SGLangBackend

    cfg = validate_config(
        {
            "rollout": {
                "backend": "sglang:d2",
                "sglang": {"startup_timeout_s": 120, "extra_env": {"AREAL_SGLANG_ORACLE_URL": oracle_url}},
            }
        },
        registry=get_registry(),
    )
    b = SGLangBackend(cfg, launch_prefix=STANDIN_PREFIX)
    addresses = b.launch(contract_model_dir, [[], []], str(tmp_path_factory.mktemp("contract")))
    assert len(addresses) == 2
    yield b, addresses
    b.stop()


@pytest.fixture
def inference_engine(backend):
    b, addresses = backend
    engine = b.make_client(addresses)
    engine.set_version(0)  # the contract starts at version 0 (also on the servers, via /update_weight_version)
    yield engine
    engine.destroy()


class TestSGLangStandInContract(InferenceEngineContract):
    def generations_running(self, engine):
        return sum(standin_state(s.address)["running"] for s in engine.servers)
