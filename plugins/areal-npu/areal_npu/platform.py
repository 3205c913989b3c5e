"""``NPUPlatform``: Ascend NPUs through torch_npu.

Everything device-specific goes through ``torch_npu.npu`` (the module that
torch_npu also installs as ``torch.npu``), imported lazily, so importing this
module needs neither torch nor torch_npu. What the rest of the code needs to
know about the device it asks this object; nothing outside it compares a
device name.

Not run on Ascend hardware by this project's tests: they run the kernel's
platform contract against this class with a test-only stand-in for
torch_npu that computes on the host (see docs/npu.md for the checks to run
on a real machine).
"""

from __future__ import annotations

import datetime
import glob
import os
from typing import Any

from areal_kernel.platforms import Platform

from areal_npu.detect import torch_npu_installed

# Where the Ascend installers put the toolkit and the driver by default.
DEFAULT_TOOLKIT_HOME = "/usr/local/Ascend/ascend-toolkit/latest"
DRIVER_VERSION_FILE = "/usr/local/Ascend/driver/version.info"

INSTALL_HINT = (
    "the npu platform needs Ascend's torch_npu built for this torch, and CANN (source its set_env.sh); see docs/npu.md"
)


def _torch_npu() -> Any:
    import torch  # noqa: F401  (first: torch_npu extends torch when it is imported)
    import torch_npu

    return torch_npu


def _npu() -> Any:
    """The device module (``torch.npu`` once torch_npu is imported)."""
    return _torch_npu().npu


def read_info_field(path: str, key: str) -> str | None:
    """The value of ``key=value`` in an Ascend ``*.info`` file (key compared
    case-insensitively), or ``None`` when the file or the key is missing."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        k, sep, v = line.partition("=")
        if sep and k.strip().lower() == key.lower() and v.strip():
            return v.strip()
    return None


def _ask_torch_npu(torch_npu: Any, module: str) -> str | None:
    # torch_npu >= the CANN 8.1 generation answers this itself; older ones
    # lack the function or return "".
    get = getattr(getattr(torch_npu, "utils", None), "get_cann_version", None)
    if get is None:
        return None
    try:
        return str(get(module=module)) or None
    except Exception:  # noqa: BLE001  (a version report never fails doctor)
        return None


def cann_version(torch_npu: Any) -> str | None:
    """CANN's version: torch_npu's answer, else the toolkit's install record
    under ``ASCEND_TOOLKIT_HOME`` / ``ASCEND_HOME_PATH`` (set by set_env.sh)."""
    found = _ask_torch_npu(torch_npu, "CANN")
    if found:
        return found
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH") or DEFAULT_TOOLKIT_HOME
    for info in sorted(glob.glob(os.path.join(home, "*", "ascend_toolkit_install.info"))):
        found = read_info_field(info, "version")
        if found:
            return found
    return None


def driver_version(torch_npu: Any) -> str | None:
    """The NPU driver's version: torch_npu's answer, else the driver's install record."""
    return _ask_torch_npu(torch_npu, "DRIVER") or read_info_field(DRIVER_VERSION_FILE, "Version")


class NPUPlatform(Platform):
    """Ascend NPUs: device ``npu``, collectives on ``hccl``, devices made
    visible with ``ASCEND_RT_VISIBLE_DEVICES``, Ray resource ``NPU``."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource_name = "NPU"
    supports_bf16 = True
    supports_cpu_offload = True

    # The derived answers hold: device memory, exclusive devices, collectives
    # on the device, in-memory (hccl) weight updates preferred, no fused
    # masked GQA assumed.

    # What each inference backend needs to run its Ascend build, keyed by the
    # backend's registered name; the backend applies them to the fields of
    # its rollout.<name> section that the user left unset. vLLM needs none:
    # vllm-ascend (areal-vllm[npu]) is a vLLM platform plugin that vLLM
    # activates by itself.
    SERVER_DEFAULTS: dict[str, dict[str, Any]] = {
        "sglang": {"device": device_type, "attention_backend": "ascend"},
    }

    # -- availability ----------------------------------------------------------
    @classmethod
    def _why_unavailable(cls) -> str | None:
        if not torch_npu_installed():
            return f"torch_npu is not installed in this environment; {INSTALL_HINT}"
        try:
            npu = _npu()
        except Exception as e:  # noqa: BLE001  (reported as the reason, one line)
            first = (str(e).strip().splitlines() or [""])[0]
            return f"import torch_npu failed ({type(e).__name__}: {first}); {INSTALL_HINT}"
        try:
            if npu.is_available():
                return None
        except Exception as e:  # noqa: BLE001
            return f"torch_npu could not query the devices ({type(e).__name__}: {e})"
        return (
            "torch_npu found no usable NPU (torch.npu.is_available() is false); check the driver "
            f"(npu-smi info) and {cls.visible_devices_env}"
        )

    @classmethod
    def is_available(cls) -> bool:
        return cls._why_unavailable() is None

    @classmethod
    def unavailable_reason(cls) -> str:
        return cls._why_unavailable() or "the npu platform is available"

    # -- devices ---------------------------------------------------------------
    def device_count(self) -> int:
        return int(_npu().device_count())

    def device(self, index: int | None = None) -> Any:
        import torch

        # Without an index: the device this process is bound to (set_device),
        # not device 0, so that buffers of a multi-device worker land on its
        # own NPU.
        return torch.device(self.device_type, _npu().current_device() if index is None else index)

    def set_device(self, index: int) -> None:
        _npu().set_device(index)

    # -- memory and sync -------------------------------------------------------
    def synchronize(self) -> None:
        _npu().synchronize()

    def memory_allocated(self) -> int:
        return int(_npu().memory_allocated())

    def max_memory_allocated(self) -> int:
        return int(_npu().max_memory_allocated())

    def empty_cache(self) -> None:
        _npu().empty_cache()

    def total_memory(self) -> int:
        npu = _npu()
        return int(npu.get_device_properties(npu.current_device()).total_memory)

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        _npu().manual_seed_all(seed)

    def device_rng_state(self) -> Any | None:
        return _npu().get_rng_state()

    def set_device_rng_state(self, state: Any) -> None:
        if state is not None:
            _npu().set_rng_state(state)

    # -- collectives -----------------------------------------------------------
    def new_process_group(
        self, backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta
    ) -> Any:
        if backend != self.dist_backend:
            return super().new_process_group(backend, store, rank, world_size, timeout)
        # torch_npu registers hccl with torch.distributed's extended creator
        # API (not callable as a plain creator); its process-group class takes
        # the same (store, rank, size, options) as ProcessGroupNCCL.
        c10d = _torch_npu()._C._distributed_c10d
        opts = c10d.ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return c10d.ProcessGroupHCCL(store, rank, world_size, opts)

    # -- inference servers -----------------------------------------------------
    def inference_server_defaults(self, backend: str) -> dict[str, Any]:
        return dict(self.SERVER_DEFAULTS.get(backend, {}))

    # -- reports ---------------------------------------------------------------
    def versions(self) -> dict[str, str]:
        torch_npu = _torch_npu()
        found = {
            "torch_npu": getattr(torch_npu, "__version__", None),
            "cann": cann_version(torch_npu),
            "driver": driver_version(torch_npu),
        }
        return {k: str(v) for k, v in found.items() if v}
