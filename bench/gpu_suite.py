"""The kernel's contract suites on one platform's device: section
``platform-suite`` of ``bench/gpu_check.py``, which runs this file in a pytest
process of its own with ``AREAL_PLATFORM`` and ``AREAL_GPU_CHECK_PLATFORM``
set to the platform under test (``cuda`` on a GPU machine, ``cpu`` in the
smoke run). Not collected by the test suite (the name does not start with
``test_`` and ``bench/`` is not a test path).

- ``PlatformContract`` against the platform the kernel resolves;
- ``TrainEngineContract`` against the torch engine, whose model must sit on
  that platform's device;
- ``InferenceEngineContract`` against two embedded servers sharing the first
  device, which must report that device.
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from areal_kernel.platforms import current_platform
from areal_kernel.testing.contracts import InferenceEngineContract, PlatformContract, TrainEngineContract, engine_maker

PLATFORM = os.environ.get("AREAL_GPU_CHECK_PLATFORM", "cuda")
os.environ["AREAL_PLATFORM"] = PLATFORM  # this process and every server it starts

# What this file holds; the section fails on any other count of passed tests.
SUITE_TESTS = 18


@pytest.fixture(scope="module")
def plat():
    p = current_platform()
    assert p.name == PLATFORM
    return p


# --------------------------------------------------------------------- platform


class TestPlatformContractOnDevice(PlatformContract):
    @pytest.fixture
    def platform(self, plat):
        return plat


def test_platform_is_the_one_under_test(plat):
    assert plat.device_count() >= 1
    assert plat.device().type == plat.device_type


# --------------------------------------------------------------------- torch engine

ENGINE_SETTINGS = {"lr": 1e-3, "max_tokens_per_mb": 8}


@pytest.fixture
def contract_model_dir(areal_tiny_model_dir):
    return areal_tiny_model_dir


@pytest.fixture
def make_train_engine(contract_model_dir):
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    return engine_maker(lambda: TorchTrainEngine(ENGINE_SETTINGS), contract_model_dir, 10)


@pytest.fixture
def train_engine(make_train_engine, plat):
    e = make_train_engine()
    assert next(e.model.parameters()).device.type == plat.device_type
    yield e
    e.destroy()


class TestTorchEngineContractOnDevice(TrainEngineContract):
    pass


# --------------------------------------------------------------------- embedded servers


@pytest.fixture(scope="module")
def contract_alt_model_dir(areal_tiny_model_dir, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    out = str(tmp_path_factory.mktemp("alt-model"))
    model = AutoModelForCausalLM.from_pretrained(areal_tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def embedded_servers(areal_tiny_model_dir, tmp_path_factory, plat):
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    # Both servers on the first device (a one-GPU machine has no second):
    # each gets one device id, and the same variable then points both at 0.
    per_server = 1 if plat.exclusive_devices else 0
    cfg = EmbeddedServerConfig(dtype="float32", extra_env=plat.visible_devices_env_for([0]) if per_server else {})
    launcher = EmbeddedLauncher(cfg, run_dir=str(tmp_path_factory.mktemp("contract")))
    try:
        yield launcher.launch(areal_tiny_model_dir, n_servers=2, devices_per_server=per_server)
    finally:
        launcher.stop()


@pytest.fixture
def inference_engine(embedded_servers):
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol

    engine = RemoteInferenceEngine([i.address for i in embedded_servers], EmbeddedProtocol())
    yield engine
    engine.destroy()


class TestEmbeddedContractOnDevice(InferenceEngineContract):
    def generations_running(self, engine):
        from areal_kernel.testing.waits import embedded_running

        return sum(embedded_running(s.address) for s in engine.servers)


def test_servers_compute_on_the_device(embedded_servers, plat):
    for s in embedded_servers:
        with urllib.request.urlopen(f"http://{s.address}/info", timeout=30) as r:
            info = json.load(r)
        assert info["device"].split(":")[0] == plat.device_type, info
