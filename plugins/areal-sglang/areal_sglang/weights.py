"""In-memory weight updates to SGLang servers (transport ``sglang_broadcast``).

What SGLang 0.5.23 does on its side (read from its source, see the README):

- ``/init_weights_update_group`` joins rank ``rank_offset + tp_rank`` of a
  ``world_size`` group through ``sglang.srt.utils.init_custom_process_group``:
  torch's ``tcp://`` rendezvous (rank 0 hosts the ``TCPStore``), a
  ``PrefixStore(group_name, store)``, then torch's process-group helper, which
  namespaces the store again by ``"<group_name>/"`` and by the backend's
  device (``"cpu/"`` for gloo, ``"cuda/"`` for nccl) before building the
  backend object.
- Inside a ``/begin_weight_update`` .. ``/end_weight_update`` session, each
  ``/update_weights_from_distributed`` with ``load_format: flattened_bucket``
  allocates ``FlattenedTensorBucket.empty(names, dtypes, shapes)``: one dense
  uint8 buffer, tensors back to back with no padding (a tensor whose offset is
  not a multiple of its dtype's itemsize is refused), receives it with one
  broadcast from rank 0 and loads the views. The HTTP call returns once the
  broadcast and the load are done.

The trainer is rank 0. It builds its end of the group on the same store keys
but without registering anything in ``torch.distributed``'s global state (the
trainer process may own a default group of its own), and sends each bucket
while every server's HTTP call for that bucket is in flight.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import ipaddress
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from areal_kernel.api.weight_transport import WeightTransport
from areal_kernel.errors import ArealError, ConfigError, ServerError

if TYPE_CHECKING:
    from areal_kernel.weights.broadcast import WeightGroup

GROUP_NAME = "areal_weights"
TRANSPORT_NAME = "sglang_broadcast"


# -- bucket planning (pure python: no torch needed) ----------------------------


def _itemsize(dtype: str) -> int:
    from areal_kernel.weights.broadcast import parse_dtype

    return parse_dtype(dtype).itemsize


def _nbytes(m: dict) -> int:
    n = 1
    for d in m["shape"]:
        if int(d) < 0:
            raise ArealError(f"tensor {m['name']!r} has a negative dimension: {m['shape']}")
        n *= int(d)
    return n * _itemsize(m["dtype"])


def plan_flattened_buckets(meta: list[dict], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``meta`` per bucket, in the order they go into the bucket.

    Consecutive tensors fill a bucket up to ``bucket_bytes`` (a bigger tensor
    gets one of its own). Inside a bucket, tensors are ordered by decreasing
    itemsize: SGLang packs them densely, and itemsizes are powers of two, so
    every offset is then a multiple of the itemsize at that offset, which is
    what ``FlattenedTensorBucket.empty`` demands.
    """
    if bucket_bytes <= 0:
        raise ConfigError(f"weight_update.bucket_mb must be > 0, got {bucket_bytes} bytes")
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, m in enumerate(meta):
        n = _nbytes(m)
        if cur and size + n > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        buckets.append(cur)
    out = []
    for b in buckets:
        ordered = sorted(b, key=lambda i: -_itemsize(meta[i]["dtype"]))  # stable: ties keep send order
        flattened_offsets([meta[i] for i in ordered])  # raises if SGLang would refuse it
        out.append(ordered)
    return out


def flattened_offsets(bucket_meta: list[dict]) -> tuple[list[int], int]:
    """Byte offset of each tensor and the buffer size, computed the way
    ``FlattenedTensorBucket.empty`` computes them (dense, refuse misaligned)."""
    offsets = []
    off = 0
    for m in bucket_meta:
        item = _itemsize(m["dtype"])
        if off % item:
            raise ArealError(
                f"tensor {m['name']!r} ({m['dtype']}) would start at byte {off}, not a multiple of its "
                f"itemsize {item}; SGLang's FlattenedTensorBucket refuses that"
            )
        offsets.append(off)
        off += _nbytes(m)
    return offsets, off


# -- the trainer's end of SGLang's group ----------------------------------------


def _device_prefix(backend: str) -> str:
    """The device name torch's process-group helper prefixes a single backend's
    store with: the first device the backend declares (gloo: cpu, nccl: cuda,
    a registered plugin backend: the devices it registered)."""
    import torch.distributed as dist

    caps = dist.Backend.backend_capability.get(backend.lower())
    if not caps:
        raise ConfigError(
            f"weight group backend {backend!r} is unknown to torch.distributed; valid: "
            f"{', '.join(sorted(dist.Backend.backend_capability))}"
        )
    return caps[0]


def _make_backend(backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    # The platform builds the backend object (gloo, nccl, or its own such as hccl).
    from areal_kernel.platforms import current_platform

    return current_platform().new_process_group(backend, store, rank, world_size, timeout)


def join_sglang_group(
    master_addr: str, master_port: int, world_size: int, group_name: str, backend: str, timeout_s: float = 600
) -> "WeightGroup":
    """Host rank 0 of the group that SGLang servers join through
    ``/init_weights_update_group``; blocks until every rank has joined."""
    import torch.distributed as dist

    from areal_kernel.weights.broadcast import WeightGroup

    if world_size < 2:
        raise ConfigError(
            f"the SGLang weight group needs the trainer and at least one server rank, got world_size={world_size}"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    # Rank 0 of torch's tcp:// rendezvous: the store daemon, multi-tenant like there.
    store = dist.TCPStore(
        master_addr,
        int(master_port),
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )
    # init_custom_process_group's prefix, then the helper's group and device prefixes.
    keyed = dist.PrefixStore(
        f"{_device_prefix(backend)}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    )
    pg = _make_backend(backend, keyed, 0, world_size, timeout)
    if hasattr(pg, "_set_sequence_number_for_group"):
        pg._set_sequence_number_for_group()  # the helper does this too
    return WeightGroup(pg, store, 0, world_size, group_name, backend)


def _master_address(server_addresses: list[str]) -> str:
    """Loopback when every server is local, else this host's address on the
    route to the first server (a UDP connect sends nothing)."""
    hosts = [a.rsplit(":", 1)[0].strip("[]") for a in server_addresses]

    def local(h: str) -> bool:
        if h == "localhost":
            return True
        try:
            return ipaddress.ip_address(h).is_loopback
        except ValueError:
            return False

    if all(local(h) for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((hosts[0], 9))
        return str(s.getsockname()[0])


def _await_all(futures: list[concurrent.futures.Future], what: str) -> list[Any]:
    """Wait for every server's answer; the first failure raises at once (the
    collective it belonged to can no longer complete)."""
    pending = set(futures)
    while pending:
        done, pending = concurrent.futures.wait(pending, timeout=0.5, return_when=concurrent.futures.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise ServerError(f"{what}: {f.exception()}")
    results = [f.result() for f in futures]
    for r in results:
        if isinstance(r, dict) and r.get("success") is False:
            raise ServerError(f"{what}: a server answered {r}")
    return results


class SGLangBroadcastTransport(WeightTransport):
    """``weight_update.mode: broadcast`` for ``rollout.backend: sglang``."""

    name = TRANSPORT_NAME
    group_name = GROUP_NAME

    def __init__(
        self, train_engine: Any, infer_engine: Any, run_dir: str, bucket_bytes: int = 256 << 20, timeout_s: float = 600
    ) -> None:
        for attr in (
            "init_weight_group_async",
            "update_bucket_async",
            "begin_weight_update",
            "end_weight_update",
            "weight_group_world_size",
        ):
            if not hasattr(infer_engine, attr):
                raise ConfigError(
                    f"weight transport {TRANSPORT_NAME!r} needs SGLang servers (rollout.backend: sglang); "
                    f"got a {type(infer_engine).__name__}"
                )
        self.train = train_engine
        self.infer = infer_engine
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = timeout_s
        self.group: "WeightGroup | None" = None
        self.backend_name: str | None = None

    def setup(self) -> None:
        from areal_kernel.platforms import current_platform
        from areal_kernel.utils.network import reserve_port

        named = self.train.named_weights_for_transfer()
        if any(getattr(t, "is_meta", False) for _, t in named):
            raise ConfigError(
                f"weight_update.mode 'broadcast' with rollout.backend 'sglang' needs the trainer's weights in "
                f"this process, but {type(self.train).__name__} keeps them in its ranks (meta tensors here); "
                "use weight_update.mode: disk with this actor.backend"
            )
        del named
        backend = current_platform().dist_backend
        self.backend_name = backend
        addr = _master_address([s.address for s in self.infer.servers])
        # Held until the join is over: the store this process hosts binds it
        # only once every server was asked to join (see PortReservation).
        with reserve_port() as reserved:
            port = reserved.port
            world = self.infer.weight_group_world_size
            futures = self.infer.init_weight_group_async(addr, port, self.group_name, backend)
            box: dict[str, Any] = {}

            def join() -> None:
                try:
                    box["group"] = join_sglang_group(addr, port, world, self.group_name, backend, self.timeout_s)
                except BaseException as e:  # surfaced below
                    box["error"] = e

            # A daemon thread: when a server refuses, we raise at once and the
            # join (blocked until its timeout) must not hold the process open.
            t = threading.Thread(target=join, name="areal-sglang-join", daemon=True)
            t.start()
            _await_all(futures, "SGLang /init_weights_update_group")
            t.join(self.timeout_s)
        if "error" in box:
            raise ServerError(f"joining SGLang's weight group as rank 0 failed: {box['error']}") from box["error"]
        if "group" not in box:
            raise ServerError(f"joining SGLang's weight group as rank 0 timed out after {self.timeout_s:.0f} s")
        self.group = box["group"]

    def _send_bucket(self, named: list[tuple[str, Any]], idx: list[int], meta: list[dict], version: int | None) -> None:
        import torch
        import torch.distributed as dist

        assert self.group is not None
        bucket_meta = [meta[i] for i in idx]
        offsets, size = flattened_offsets(bucket_meta)
        futures = self.infer.update_bucket_async(
            [m["name"] for m in bucket_meta],
            [m["dtype"] for m in bucket_meta],
            [m["shape"] for m in bucket_meta],
            self.group_name,
            version,
        )
        buf = torch.empty(size, dtype=torch.uint8, device=self.group.buffer_device())
        for i, off in zip(idx, offsets):
            t = named[i][1].detach().reshape(-1).view(torch.uint8)
            buf[off : off + t.numel()].copy_(t)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        work = self.group.backend.broadcast([buf], opts)
        try:
            _await_all(futures, f"SGLang /update_weights_from_distributed ({len(idx)} tensors, {size} bytes)")
        except ServerError:
            # The collective is now out of step on some rank: the group is unusable.
            self.group = None
            raise
        work.wait()

    def update(self, version: int) -> dict[str, float]:
        from areal_kernel.platforms import current_platform
        from areal_kernel.weights.broadcast import tensor_meta

        if self.group is None:
            raise ArealError(
                f"weight transport {TRANSPORT_NAME!r}: no weight group (setup() not run, or a previous update failed)"
            )
        named = self.train.named_weights_for_transfer()
        meta = tensor_meta(named)
        buckets = plan_flattened_buckets(meta, self.bucket_bytes)
        nbytes = sum(_nbytes(m) for m in meta)
        t0 = time.monotonic()
        self.infer.pause()
        try:
            self.infer.begin_weight_update()
            try:
                for k, idx in enumerate(buckets):
                    self._send_bucket(named, idx, meta, version if k == len(buckets) - 1 else None)
                current_platform().synchronize()
            except BaseException:
                try:  # close SGLang's session so the servers stay usable; the first error wins
                    self.infer.end_weight_update()
                except ServerError:
                    pass
                raise
            self.infer.end_weight_update()
            self.infer.note_version(version)
        finally:
            self.infer.resume()
        dt = time.monotonic() - t0
        return {
            "weights/broadcast_s": dt,
            "weights/pause_s": dt,
            "weights/mb": nbytes / 2**20,
            "weights/buckets": float(len(buckets)),
        }

    def close(self) -> None:
        if self.group is not None:
            try:
                self.infer.destroy_weight_group(self.group_name)
            except ServerError:
                pass  # servers already gone: nothing left to free there
            self.group.destroy()
            self.group = None
