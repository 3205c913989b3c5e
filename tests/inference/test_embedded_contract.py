"""The built-in embedded backend passes the kernel's inference-engine contract."""
import pytest
import torch

from areal_kernel.inference.client import RemoteInferenceEngine
from areal_kernel.inference.embedded.backend import EmbeddedProtocol
from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
from areal_kernel.testing.contracts import InferenceEngineContract
from areal_kernel.testing.waits import embedded_running


@pytest.fixture(scope="module")
def contract_model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def contract_alt_model_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path_factory.mktemp("alt-model"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def embedded_servers(tiny_model_dir, tmp_path_factory):
    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=str(tmp_path_factory.mktemp("contract")))
    try:
        yield launcher.launch(tiny_model_dir, n_servers=2, devices_per_server=0)
    finally:
        launcher.stop()


@pytest.fixture
def inference_engine(embedded_servers):
    engine = RemoteInferenceEngine([i.address for i in embedded_servers], EmbeddedProtocol())
    yield engine
    engine.destroy()


class TestEmbeddedBackendContract(InferenceEngineContract):
    def generations_running(self, engine):
        return sum(embedded_running(s.address) for s in engine.servers)
