"""The ``Platform`` interface and the built-in ``cpu`` and ``cuda`` platforms."""
from __future__ import annotations

import os
from typing import Any, ClassVar


class Platform:
    """One device kind. Subclass it to add hardware (see ``areal-npu``).

    Class attributes describe the device; methods import torch lazily so that
    resolving a platform stays cheap.
    """

    name: ClassVar[str] = "base"
    device_type: ClassVar[str] = "cpu"  # what torch.device() takes
    dist_backend: ClassVar[str] = "gloo"  # torch.distributed backend for collectives
    visible_devices_env: ClassVar[str | None] = None  # e.g. CUDA_VISIBLE_DEVICES
    ray_resource_name: ClassVar[str | None] = None  # e.g. "GPU"
    supports_bf16: ClassVar[bool] = True
    supports_cpu_offload: ClassVar[bool] = False

    @classmethod
    def is_available(cls) -> bool:
        """Cheap probe: can this platform be used in this process?"""
        return True

    # -- devices -------------------------------------------------------------
    def device_count(self) -> int:
        return 1

    def device(self, index: int | None = None) -> Any:
        import torch

        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, 0 if index is None else index)

    def set_device(self, index: int) -> None:
        """Bind this process to device ``index`` (no-op on CPU)."""

    def visible_devices_env_for(self, device_ids: list[int]) -> dict[str, str]:
        """Environment that restricts a child process to ``device_ids``."""
        if not self.visible_devices_env:
            return {}
        return {self.visible_devices_env: ",".join(str(d) for d in device_ids)}

    # -- memory and sync -----------------------------------------------------
    def synchronize(self) -> None:
        """Wait for queued device work to finish (for timing and transfers)."""

    def memory_allocated(self) -> int:
        """Bytes currently held by tensors on this process's device."""
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def empty_cache(self) -> None:
        """Release cached, unused device memory."""

    def total_memory(self) -> int:
        """Bytes of memory on one device (host RAM on CPU)."""
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return 0

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "visible_devices_env": self.visible_devices_env,
            "ray_resource_name": self.ray_resource_name,
            "device_count": self.device_count(),
        }

    def __repr__(self) -> str:
        return f"<Platform {self.name}>"


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None
    ray_resource_name = None
    supports_bf16 = True

    def device_count(self) -> int:
        return 1


class CudaPlatform(Platform):
    """NVIDIA GPUs. The only module allowed to touch ``torch.cuda``."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource_name = "GPU"
    supports_cpu_offload = True

    @classmethod
    def is_available(cls) -> bool:
        # Avoid importing torch just to find out there is no driver.
        if not (os.path.exists("/dev/nvidiactl") or os.environ.get(cls.visible_devices_env or "")):
            return False
        try:
            import torch

            return bool(torch.cuda.is_available())
        except Exception:
            return False

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count()

    def set_device(self, index: int) -> None:
        import torch

        torch.cuda.set_device(index)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated())

    def max_memory_allocated(self) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated())

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def total_memory(self) -> int:
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
