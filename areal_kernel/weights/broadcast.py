"""In-memory weight transfer over a private torch.distributed group.

Rank 0 is the trainer, ranks 1..n the inference servers. Why a *private*
group: the trainer usually already has a default process group (FSDP ranks)
and the servers are unrelated jobs, so ``new_group`` (which needs every rank of
the default group) cannot be used, and ``init_process_group`` may not be called
twice. We therefore build the collective backend object directly on its own
``TCPStore`` (namespaced by ``group_name`` through a ``PrefixStore``) and call
its collectives on the object. That touches no global state of
``torch.distributed``: the default group, if any, is left alone, and the group
can be torn down and rebuilt freely. The backend constructors
(``ProcessGroupGloo``/``ProcessGroupNCCL``) have been stable public classes for
many torch releases, unlike the private ``_new_process_group_helper``.

Wire format: tensors are sent in buckets; each bucket is one flat ``uint8``
buffer holding the raw bytes of its tensors at 64-byte-aligned offsets. Both
sides compute the same bucket plan from the same metadata, so nothing but the
buffers themselves travels (no pickles).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from areal_kernel.errors import ArealError, ConfigError

if TYPE_CHECKING:
    import torch

ALIGN = 64  # byte alignment of each tensor inside a bucket (lets receivers view, not copy)


@dataclass
class WeightGroup:
    """A private collective group: the backend object plus its store."""

    backend: Any  # a torch.distributed Backend / ProcessGroup object
    store: Any
    rank: int
    world_size: int
    group_name: str
    backend_name: str

    def broadcast_(self, tensor: "torch.Tensor", src: int = 0) -> None:
        """In-place broadcast of ``tensor`` from rank ``src`` to every rank."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.backend.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        """Cheap barrier: broadcast one byte (works on every backend)."""
        import torch

        self.broadcast_(torch.zeros(1, dtype=torch.uint8, device=self.buffer_device()))

    def buffer_device(self) -> "torch.device":
        """Where bucket buffers live: host memory for gloo, the device otherwise."""
        import torch

        if self.backend_name == "gloo":
            return torch.device("cpu")
        from areal_kernel.platforms import current_platform

        return current_platform().device()

    def destroy(self) -> None:
        # Dropping the references closes the connections; there is no global
        # registry entry to remove because the group was never registered.
        self.backend = None
        self.store = None


def _make_backend(name: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    # The platform builds it: gloo and nccl here, and a platform plugin's own
    # backend (hccl on Ascend) through its override.
    from areal_kernel.platforms import current_platform

    return current_platform().new_process_group(name, store, rank, world_size, timeout)


def init_weight_group(
    master_addr: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    backend: str | None = None,
    timeout_s: float = 300,
) -> WeightGroup:
    """Join (rank 0: host) the private group ``group_name``.

    Blocks until all ``world_size`` ranks have joined. Rank 0 hosts the
    ``TCPStore`` on ``master_addr:master_port``. ``backend`` defaults to the
    current platform's distributed backend.
    """
    import torch.distributed as dist

    if world_size < 2:
        raise ConfigError(f"init_weight_group: world_size must be >= 2 (trainer + servers), got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"init_weight_group: rank must be in [0, {world_size}), got {rank}")
    if not group_name:
        raise ConfigError("init_weight_group: group_name must be a non-empty string")
    if backend is None:
        from areal_kernel.platforms import current_platform

        backend = current_platform().dist_backend
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_addr,
        int(master_port),
        world_size,
        is_master=(rank == 0),
        timeout=timeout,
        wait_for_workers=False,
    )
    prefixed = dist.PrefixStore(f"areal_weights/{group_name}", store)
    pg = _make_backend(backend, prefixed, rank, world_size, timeout)
    return WeightGroup(pg, store, rank, world_size, group_name, backend)


# -- planning -----------------------------------------------------------------


def _dtype_name(dtype: "torch.dtype") -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> "torch.dtype":
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``ArealError`` on junk."""
    import torch

    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ArealError(f"unknown dtype {name!r}; valid e.g. 'float32', 'bfloat16', 'float16'")
    return dt


def tensor_meta(named: Iterable[tuple[str, "torch.Tensor"]]) -> list[dict]:
    """JSON-able ``[{"name", "dtype", "shape"}]`` describing ``named`` in order."""
    return [{"name": n, "dtype": _dtype_name(t.dtype), "shape": list(t.shape)} for n, t in named]


def _meta_nbytes(m: dict) -> int:
    import math

    return math.prod(m["shape"]) * parse_dtype(m["dtype"]).itemsize


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(meta: list[dict], bucket_bytes: int) -> list[list[int]]:
    """Split tensor indices into consecutive buckets of at most ``bucket_bytes``
    (aligned sizes). A tensor larger than ``bucket_bytes`` gets a bucket of its
    own. Deterministic: depends only on ``meta`` and ``bucket_bytes``."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, m in enumerate(meta):
        n = _aligned(_meta_nbytes(m))
        if cur and size + n > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        buckets.append(cur)
    return buckets


def _layout(meta: list[dict], bucket: list[int]) -> tuple[list[tuple[int, int]], int]:
    """(offset, nbytes) of each tensor of ``bucket`` and the buffer size."""
    spans = []
    off = 0
    for i in bucket:
        n = _meta_nbytes(meta[i])
        spans.append((off, n))
        off += _aligned(n)
    return spans, off


# -- transfer -----------------------------------------------------------------


def _as_bytes(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8)


def send_buckets(
    group: WeightGroup, named_tensors: Iterable[tuple[str, "torch.Tensor"]], bucket_bytes: int
) -> list[dict]:
    """Rank 0: broadcast ``named_tensors`` bucket by bucket. Receivers must be
    given the same metadata (``tensor_meta``) and ``bucket_bytes``. Returns
    that metadata."""
    import torch

    if group.rank != 0:
        raise ArealError(f"send_buckets must run on rank 0, this is rank {group.rank}")
    named = list(named_tensors)
    meta = tensor_meta(named)
    device = group.buffer_device()
    for bucket in plan_buckets(meta, bucket_bytes):
        spans, size = _layout(meta, bucket)
        if size == 0:  # only empty tensors: nothing to send (receivers skip too)
            continue
        buf = torch.zeros(size, dtype=torch.uint8, device=device)
        for i, (off, n) in zip(bucket, spans):
            buf[off : off + n].copy_(_as_bytes(named[i][1]))
        group.broadcast_(buf, src=0)
    return meta


def recv_buckets(group: WeightGroup, meta: list[dict], bucket_bytes: int) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Ranks > 0: receive what ``send_buckets`` sends and yield ``(name,
    tensor)``. Tensors are views into the bucket buffer: copy them out (e.g.
    into model parameters) before keeping them long-term."""
    import torch

    if group.rank == 0:
        raise ArealError("recv_buckets runs on receivers (rank > 0); rank 0 calls send_buckets")
    device = group.buffer_device()
    for bucket in plan_buckets(meta, bucket_bytes):
        spans, size = _layout(meta, bucket)
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        if size:
            group.broadcast_(buf, src=0)
        for i, (off, n) in zip(bucket, spans):
            m = meta[i]
            dtype = parse_dtype(m["dtype"])
            raw = buf[off : off + n]
            t = raw.view(torch.uint8 if dtype == torch.bool else dtype)
            if dtype == torch.bool:
                t = t.to(torch.bool)
            yield m["name"], t.view(m["shape"])
