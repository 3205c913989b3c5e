"""The ``Platform`` interface and the built-in ``cpu`` and ``cuda`` platforms."""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from pydantic import BaseModel

SettingsT = TypeVar("SettingsT", bound="BaseModel")


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
    supports_cpu_offload: ClassVar[bool] = False  # can shards move from device to host memory?

    @classmethod
    def is_available(cls) -> bool:
        """Cheap probe: can this platform be used in this process?"""
        return True

    @classmethod
    def unavailable_reason(cls) -> str:
        """One line saying why ``is_available()`` is false (what is missing and
        what to install or set). ``AREAL_PLATFORM=<name>`` naming a platform
        that is not available fails with this line."""
        return f"no {cls.device_type} device is usable in this process ({cls.__name__}.is_available() is false)"

    # -- capabilities ----------------------------------------------------------
    # Code outside this package decides through these, never by comparing
    # ``device_type`` or ``name`` with a string, so that a third-party platform
    # answers the same questions by overriding them. The defaults are derived
    # from ``device_type`` and ``dist_backend`` so that an accelerator subclass
    # which only sets those gets accelerator behaviour.

    @property
    def host_memory(self) -> bool:
        """Tensors on this platform's device live in host memory: copying them
        to the CPU is free, there is no separate device RNG, and backends size
        their caches in host RAM instead of a device-memory fraction."""
        return self.device_type == "cpu"

    @property
    def exclusive_devices(self) -> bool:
        """Each process is given its own device ids and devices are never shared
        between processes (a run that needs more devices than exist cannot
        start). ``False``: the compute units are host cores that processes
        share; oversubscribing them is slower but allowed."""
        return not self.host_memory

    @property
    def compute_unit_name(self) -> str:
        """What ``compute_units()`` counts, for messages and ``areal plan``."""
        return "CPU cores" if not self.exclusive_devices else f"{self.device_type} devices"

    def compute_units(self) -> int:
        """How many units the scheduler may hand out: devices, or host cores
        where ``exclusive_devices`` is ``False``."""
        return self.device_count() if self.exclusive_devices else (os.cpu_count() or 1)

    @property
    def collectives_on_host(self) -> bool:
        """Tensors passed to this platform's ``dist_backend`` must be host
        tensors (gloo); otherwise they live on ``device()``."""
        return self.dist_backend == "gloo"

    def collective_device(self) -> Any:
        """The torch device for tensors handed to ``dist_backend`` collectives."""
        import torch

        return torch.device("cpu") if self.collectives_on_host else self.device()

    @property
    def prefers_in_memory_weight_updates(self) -> bool:
        """Whether ``weight_update.mode: auto`` should pick an in-memory
        (collective broadcast) transport when the inference backend offers
        one. ``False`` where a safetensors round trip through the page cache
        pauses generation less than a broadcast does."""
        return not self.collectives_on_host

    @property
    def fused_masked_gqa_attention(self) -> bool:
        """SDPA's fused kernel accepts a boolean padding mask together with
        ``enable_gqa=True`` (no need to repeat KV heads first). Used by the
        embedded server's ``areal_sdpa`` attention."""
        return False

    def device_rng_state(self) -> Any | None:
        """The device RNG state to checkpoint, or ``None`` where there is no
        device RNG apart from torch's CPU generator (``host_memory``)."""
        if self.host_memory:
            return None
        import torch

        return torch.get_device_module(self.device_type).get_rng_state()

    def set_device_rng_state(self, state: Any) -> None:
        """Restore what ``device_rng_state`` returned (ignored without a device RNG)."""
        if state is None or self.host_memory:
            return
        import torch

        torch.get_device_module(self.device_type).set_rng_state(state)

    # -- devices -------------------------------------------------------------
    def device_count(self) -> int:
        return 1

    def device(self, index: int | None = None) -> Any:
        import torch

        if self.host_memory:
            return torch.device(self.device_type)
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

    def versions(self) -> dict[str, str]:
        """Versions of the device software stack beside torch (runtime, driver,
        collective library, ...) for ``areal doctor``; empty where there is none."""
        return {}

    # -- collectives -----------------------------------------------------------
    def new_process_group(
        self, backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta
    ) -> Any:
        """A standalone collective backend object (``ProcessGroupGloo``-like:
        ``broadcast([t], opts).wait()``) of kind ``backend`` on ``store``, not
        registered in torch.distributed's global state. The kernel's in-memory
        weight groups are built through this, in the trainer and in inference
        workers, so a platform whose backend needs its own constructor
        (``hccl``) overrides it for that name and defers to this for the rest."""
        import torch.distributed as dist

        if backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False  # what torch's own group helper sets
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, world_size, opts)
        # Other backends registered with torch.distributed.Backend.register_backend
        # through its plain (store, rank, size, timeout) creator signature.
        plugin = dist.Backend._plugins.get(backend.upper())
        if plugin is None or getattr(plugin, "extended_api", False):
            from areal_kernel.errors import ConfigError

            raise ConfigError(
                f"collective backend {backend!r} cannot be built on platform {self.name!r}; valid: 'gloo', "
                f"'nccl', a backend registered with torch.distributed.Backend.register_backend (plain creator), "
                f"or one the platform builds itself (Platform.new_process_group)"
            )
        return plugin.creator_fn(store, rank, world_size, timeout)

    # -- inference servers -------------------------------------------------------
    def inference_server_defaults(self, backend: str) -> dict[str, Any]:
        """Settings this platform gives inference backend ``backend`` (its
        registered name): ``{field of its rollout.<backend> section: value}``,
        used only for fields the user left unset. This is how a device's
        variant of a backend is selected without the backend knowing device
        names (e.g. the npu platform gives ``sglang`` its ``device`` and
        ``attention_backend``). Default: none."""
        return {}

    def apply_server_defaults(self, backend: str, section: SettingsT) -> SettingsT:
        """``section`` (the validated ``rollout.<backend>`` settings) with
        ``inference_server_defaults(backend)`` filled into the fields the user
        did not set, validated again by the section's own model. Backends call
        this once when they read their section."""
        defaults = self.inference_server_defaults(backend)
        if not defaults:
            return section
        from pydantic import ValidationError

        from areal_kernel.errors import ConfigError

        cls = type(section)
        unknown = sorted(set(defaults) - set(cls.model_fields))
        if unknown:
            raise ConfigError(
                f"platform {self.name!r} gives rollout.{backend} the setting(s) {unknown}, which "
                f"{cls.__name__} does not have; update the platform plugin or the backend plugin"
            )
        given = section.model_dump(exclude_unset=True)
        merged = {**{k: v for k, v in defaults.items() if k not in section.model_fields_set}, **given}
        try:
            return cls.model_validate(merged)
        except ValidationError as e:
            raise ConfigError(f"rollout.{backend} with the defaults of platform {self.name!r}: {e}") from None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "visible_devices_env": self.visible_devices_env,
            "ray_resource_name": self.ray_resource_name,
            "device_count": self.device_count(),
            "host_memory": self.host_memory,
            "exclusive_devices": self.exclusive_devices,
            "collectives_on_host": self.collectives_on_host,
            "prefers_in_memory_weight_updates": self.prefers_in_memory_weight_updates,
            "supports_cpu_offload": self.supports_cpu_offload,
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
    # Shards already live in host memory; FSDP's offload policy refuses a cpu device.
    supports_cpu_offload = False

    # The derived answers hold here: host memory, shared cores (a "device" is
    # a core; single-threaded processes share them), and no preference for
    # in-memory weight updates over gloo, as measured (bench/bench_weight_update.py,
    # SmolLM2): the safetensors round trip pauses generation ~0.15 s, a gloo
    # broadcast blocks both sides ~1.5 s.

    @property
    def fused_masked_gqa_attention(self) -> bool:
        # Measured on one core (16 rows, 1024 cached tokens, 9 query / 3 KV
        # heads): 6 ms per layer instead of 93 ms, identical outputs.
        return True

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

    # The derived answers hold here: device memory, exclusive devices, in-memory
    # (NCCL) weight updates preferred over a disk round trip, no fused masked
    # GQA (it falls back to the math kernel), and the device RNG through
    # torch.get_device_module("cuda").

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

    def versions(self) -> dict[str, str]:
        import torch

        return {"cuda": str(torch.version.cuda)}
