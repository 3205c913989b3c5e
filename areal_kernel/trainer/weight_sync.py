"""Weight transports: how new train-engine weights reach the inference servers.

Both keep generation interruptible: servers are paused only for the moment
the weights change (running requests return their partial output and resume
afterwards on the new version). An adapter's update pauses nothing where the
server interrupts that adapter's rows alone (``ServerProtocol.adapter_update_scoped``):
the base's and other adapters' requests go on undisturbed.

When the train engine trains a LoRA adapter (``TrainEngine.adapter_spec``),
both send the adapter alone (``WeightUpdateMeta.adapter``): ``disk`` writes a
peft adapter directory the servers load under the adapter's name; ``broadcast``
sends the adapter's tensors over the weight group to servers that take them
in memory (``ServerProtocol.adapter_broadcast``) and otherwise ships the
(small) adapter directory like ``disk``.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from areal_kernel.api.engine import TrainEngine, WeightUpdateMeta
from areal_kernel.api.weight_transport import WeightTransport
from areal_kernel.errors import ServerError


def pauses_for(infer: Any, adapter: str | None) -> bool:
    """Whether an update must pause every generation: always for the base
    weights; for an adapter only where the servers cannot interrupt that
    adapter's rows alone."""
    return adapter is None or not getattr(getattr(infer, "protocol", None), "adapter_update_scoped", False)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


class DiskTransport(WeightTransport):
    """Save an HF directory (safetensors), then each server reloads it."""

    name = "disk"

    def __init__(self, train_engine: TrainEngine, infer_engine: Any, run_dir: str, bucket_bytes: int = 0) -> None:
        self.train: TrainEngine = train_engine
        self.infer = infer_engine
        self.root = os.path.join(run_dir, "weights")
        # The directories still on disk, oldest first: the last update's, and
        # for an adapter the one before it too (see ``update``).
        self._kept: list[str] = []

    def setup(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def update(self, version: int) -> dict[str, float]:
        spec = self.train.adapter_spec()
        adapter = spec.name if spec is not None else None
        # A per-adapter directory: runs sharing servers may share a run dir's parent, never a path.
        path = os.path.join(self.root, f"{adapter}-v{version}" if adapter else f"v{version}")
        t0 = time.monotonic()
        # Saving happens while servers keep generating with the old weights.
        self.train.send_weights(WeightUpdateMeta(kind="disk", version=version, path=path, adapter=adapter))
        t1 = time.monotonic()
        pause = pauses_for(self.infer, adapter)
        if pause:
            self.infer.pause()
        try:
            self.infer.update_weights(WeightUpdateMeta(kind="disk", version=version, path=path, adapter=adapter))
        finally:
            if pause:
                self.infer.resume()
        t2 = time.monotonic()
        nbytes = _dir_bytes(path)
        # An adapter's previous directory stays one update longer: a server
        # may read it again for a request that was already on its way (vLLM
        # reloads a replaced adapter lazily, per request).
        self._kept = [d for d in self._kept if d != path] + [path]
        while len(self._kept) > (1 if adapter is None else 2):
            shutil.rmtree(self._kept.pop(0), ignore_errors=True)
        return {
            "weights/save_s": t1 - t0,
            "weights/load_s": t2 - t1,
            "weights/pause_s": t2 - t1 if pause else 0.0,
            "weights/mb": nbytes / 2**20,
        }

    def admit(self, addresses: list[str], version: int) -> dict[str, float]:
        """The last update's directory (and adapters) loaded into the held
        servers at ``addresses`` alone; they are released after."""
        t0 = time.monotonic()
        for a in addresses:
            self.infer.replay_disk(a)
            self.infer.release(a)
        return {"weights/admit_s": time.monotonic() - t0}

    def close(self) -> None:
        """Remove the last weight directories it wrote (the earlier ones went at
        the updates) and ``weights/`` if nothing else is there: once the
        servers are stopped nobody reads it, and each SmolLM2 run left 0.5 GB
        behind. The run's checkpoints hold the weights worth keeping."""
        for d in self._kept:
            shutil.rmtree(d, ignore_errors=True)
        self._kept = []
        try:
            os.rmdir(self.root)
        except OSError:
            pass  # not there, or holds something this transport did not write


class BroadcastTransport(WeightTransport):
    """In-memory: rank 0 (the trainer) broadcasts bucketed tensors to every
    server over a torch.distributed group (the platform's backend: gloo on
    CPU, nccl on CUDA).

    The group follows the fleet: ``update`` compares the servers the group
    was formed with to the client's current members
    (``group_members()``: a server joined, drained or dead and restarted)
    and re-forms it first when they differ (``weights/group_reforms``,
    ``weights/reform_s``); the servers keep generating meanwhile. ``admit``
    sends the current weights to newly started servers alone, over a group
    of the trainer and them, so the rest of the fleet is not paused."""

    name = "broadcast"
    group_name = "areal_weights"
    # How long the trainer's side of a group waits for a member (forming,
    # and each transfer): a server that died inside a transfer surfaces after it.
    group_timeout_s: float = 300.0
    # The group's collective backend; None: the platform's (gloo on CPU,
    # nccl on CUDA). A caller may pick another the engine and servers both
    # support (gloo between two processes on one GPU, where nccl refuses).
    backend: str | None = None

    def __init__(
        self, train_engine: TrainEngine, infer_engine: Any, run_dir: str, bucket_bytes: int = 256 << 20
    ) -> None:
        self.train: TrainEngine = train_engine
        self.infer = infer_engine
        self.bucket_bytes = bucket_bytes
        self._meta: list[dict] | None = None
        # Adapters for servers that load them only from a directory.
        self._adapter_disk = DiskTransport(train_engine, infer_engine, run_dir)
        # The servers of the current group, in rank order (None: none formed).
        self._members: tuple[str, ...] | None = None
        self._group = self.group_name
        self._epoch = 0  # groups formed so far: each gets its own name (and store port)
        self.reforms = 0  # re-forms after the first group (fleet changes)
        # A client that tracks its fleet (the kernel's RemoteInferenceEngine);
        # another InferenceEngine runs with the servers it started with.
        self._fleet_aware = hasattr(infer_engine, "group_members")

    def setup(self) -> None:
        self._form(self._current_members())
        self.reforms = 0

    def _current_members(self) -> list[str] | None:
        return list(self.infer.group_members()) if self._fleet_aware else None

    def _form(self, members: list[str] | None) -> float:
        """(Re-)form the weight group of the trainer and ``members`` (None:
        whatever servers the engine has); returns the seconds it took."""
        from areal_kernel.platforms import current_platform
        from areal_kernel.utils.network import reserve_port

        t0 = time.monotonic()
        backend = self.backend or current_platform().dist_backend
        name = self.group_name if self._epoch == 0 else f"{self.group_name}_{self._epoch}"
        # The port is held from the moment the servers are told it until the
        # trainer's store listens on it (the group is formed): a free port
        # looked up and let go could be taken in between by any other
        # process's bind or connection, and the store would then fail to bind.
        with reserve_port("127.0.0.1") as reserved:
            port = reserved.port
            if members is None:
                futures = self.infer.init_weight_group_async("127.0.0.1", port, name, backend)
                # Servers may contribute several ranks each (tensor-parallel workers).
                world = getattr(self.infer, "weight_group_world_size", 1 + len(futures))
            else:
                futures = self.infer.init_weight_group_async("127.0.0.1", port, name, backend, addresses=members)
                world = self.infer.weight_group_world_size_for(len(members))
            self.train.init_weight_group(
                "127.0.0.1",
                port,
                world_size=world,
                rank=0,
                group_name=name,
                backend=backend,
                timeout_s=self.group_timeout_s,
            )
            for f in futures:
                f.result()
        self._members = tuple(members) if members is not None else ()
        self._group = name
        self._epoch += 1
        self.reforms += 1
        return time.monotonic() - t0

    def update(self, version: int) -> dict[str, float]:
        spec = self.train.adapter_spec()
        if spec is not None and not getattr(getattr(self.infer, "protocol", None), "adapter_broadcast", False):
            self._adapter_disk.setup()
            return self._adapter_disk.update(version)
        members = self._current_members()
        out: dict[str, float] = {}
        if members is not None and tuple(members) != self._members:
            # The fleet changed since the group formed: re-form before the
            # pause, while the servers still generate.
            out["weights/reform_s"] = self._form(members)
        t0 = time.monotonic()
        pause = pauses_for(self.infer, None if spec is None else spec.name)
        if pause:
            self.infer.pause()
        broken = False
        try:
            try:
                nbytes = self._send(version, spec, members)
            except RuntimeError as e:  # the collective backend's error (gloo: "Connection reset by peer")
                # The other servers wait in the transfer until their group's
                # timeout: resuming them would block as long. The run stops
                # here and stops them.
                broken = True
                raise ServerError(
                    f"the in-memory weight update to version {version} failed: {str(e).splitlines()[0][:300]}; "
                    "a server probably died during the transfer, which cannot be recovered in the middle of a "
                    "broadcast (between updates the fleet re-forms the group); the same command with "
                    "recover: auto resumes from the last recovery checkpoint"
                ) from e
            self.infer.set_version(version)
        finally:
            if pause and not broken:
                self.infer.resume()
        dt = time.monotonic() - t0
        if members is not None:
            self._release_stale(members)
        out.update({"weights/broadcast_s": dt, "weights/pause_s": dt if pause else 0.0, "weights/mb": nbytes / 2**20})
        out["weights/group_reforms"] = float(self.reforms)
        return out

    def admit(self, addresses: list[str], version: int) -> dict[str, float]:
        """The current weights to the (held) servers at ``addresses`` alone:
        a group of the trainer and them, then one transfer. The next
        ``update`` re-forms the group over the whole fleet."""
        if not self._fleet_aware:
            return super().admit(addresses, version)
        spec = self.train.adapter_spec()
        t0 = time.monotonic()
        if spec is not None and not getattr(self.infer.protocol, "adapter_broadcast", False):
            for a in addresses:  # adapters travel as directories: replay the last one
                self.infer.replay_disk(a)
                self.infer.release(a)
            return {"weights/admit_s": time.monotonic() - t0}
        reform_s = self._form(list(addresses))
        self._send(version, spec, list(addresses))
        self._release_stale(addresses)
        return {"weights/admit_s": time.monotonic() - t0, "weights/reform_s": reform_s}

    def _send(self, version: int, spec: Any, members: list[str] | None) -> int:
        """One transfer over the current group: the servers' receive calls in
        flight while the engine sends. Returns the bytes sent."""
        from areal_kernel.weights.broadcast import tensor_meta

        # The engine's transfer set is the adapter alone when it trains one.
        named = self.train.named_weights_for_transfer()
        meta = tensor_meta(named)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        del named
        extra = {} if members is None else {"addresses": members}
        if spec is None:
            futures = self.infer.update_from_distributed_async(meta, version, self.bucket_bytes, self._group, **extra)
        else:
            futures = self.infer.update_adapter_from_distributed_async(
                spec.name, spec.config, meta, version, self.bucket_bytes, self._group, **extra
            )
        self.train.send_weights(
            WeightUpdateMeta(
                kind="broadcast",
                version=version,
                bucket_bytes=self.bucket_bytes,
                adapter=None if spec is None else spec.name,
            )
        )
        for f in futures:
            f.result()
        return nbytes

    def _release_stale(self, addresses: Any) -> None:
        """Servers that were waiting for the weights (joined, restarted)
        carry them now: requests may go there."""
        wanted = set(addresses)
        for s in list(self.infer.servers):
            if s.address in wanted and s.stale:
                self.infer.release(s.address)

    def close(self) -> None:
        self._adapter_disk.close()
