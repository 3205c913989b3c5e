"""Platform resolution: built-in cpu, AREAL_PLATFORM override, out-of-tree probes."""
import pytest

from areal_kernel.errors import ArealError
from areal_kernel.platforms import current_platform
from areal_kernel.testing.contracts import PlatformContract


class TestCpuPlatformContract(PlatformContract):
    @pytest.fixture
    def platform(self, areal_env):
        areal_env(AREAL_PLATFORM="cpu")
        return current_platform()


def test_default_is_cpu_here(areal_env):
    areal_env(AREAL_PLATFORM=None)
    plat = current_platform()
    assert plat.name == "cpu" and plat.dist_backend == "gloo"
    assert current_platform() is plat  # resolved once


def test_areal_platform_selects_a_registered_platform(with_test_plugins, areal_env):
    areal_env(AREAL_PLATFORM="testaccel")
    plat = current_platform()
    assert plat.name == "testaccel"
    assert plat.visible_devices_env_for([2, 3]) == {"TESTACCEL_VISIBLE_DEVICES": "2,3"}


def test_out_of_tree_probe(with_test_plugins, areal_env):
    areal_env(AREAL_PLATFORM=None, AREAL_TEST_ACCEL="1")
    assert current_platform().name == "testaccel"
    areal_env(AREAL_PLATFORM=None, AREAL_TEST_ACCEL="0")
    assert current_platform().name == "cpu"


def test_unknown_platform_is_a_clear_error(areal_env):
    areal_env(AREAL_PLATFORM="tpu9000")
    with pytest.raises(ArealError) as e:
        current_platform()
    msg = str(e.value)
    assert "AREAL_PLATFORM='tpu9000' is not usable" in msg and "Available: cpu, cuda" in msg


# path -> why it may name torch.cuda. Every entry needs a reason.
NAMES_TORCH_CUDA = {
    # Replaces megatron-core's own hard-coded torch.cuda calls, only on the
    # host platform (the "one module, active only on cpu").
    "plugins/areal-megatron/areal_megatron/cpu_redirect.py": "megatron-core's CUDA calls redirected on cpu",
}


def test_nothing_outside_the_platform_layer_calls_torch_cuda():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in list((root / "areal_kernel").rglob("*.py")) + list((root / "plugins").rglob("*.py")):
        if path.name == "base.py" and path.parent.name == "platforms":
            continue
        if "tests" in path.parts:
            continue
        if path.relative_to(root).as_posix() in NAMES_TORCH_CUDA:
            continue
        if "torch.cuda" in path.read_text(encoding="utf-8"):
            offenders.append(str(path.relative_to(root)))
    assert offenders == []
