"""The ``sglang`` inference backend: launcher + SGLang's wire format + the kernel's generic client."""
from __future__ import annotations

import concurrent.futures
import urllib.error
import urllib.request
from typing import Any

from areal_kernel.errors import ServerError
from areal_kernel.inference.client import RemoteInferenceEngine
from areal_kernel.inference.wire import HttpCall

from areal_sglang.config import SGLangServerConfig
from areal_sglang.protocol import SGLangProtocol


class SGLangInferenceEngine(RemoteInferenceEngine):
    """The kernel's client (retries, affinity, failover, interruption) plus
    SGLang's own control calls."""

    protocol: SGLangProtocol

    def __init__(self, addresses: list[str], protocol: SGLangProtocol | None = None, *, tp_size: int = 1, **kw: Any) -> None:
        super().__init__(addresses, protocol or SGLangProtocol(), **kw)
        self.tp_size = tp_size

    def _control(self, server: Any, call: HttpCall) -> Any:
        # /flush_cache answers plain text ("Cache flushed."), not JSON.
        if call.path != "/flush_cache":
            return super()._control(server, call)
        req = urllib.request.Request(server.url(call.path), data=b"", headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=call.timeout_s or self.control_timeout_s) as resp:
                return {"text": resp.read().decode(errors="replace")}
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise ServerError(f"{server.address}{call.path} answered HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ServerError(f"{server.address}{call.path} failed: {e}") from None

    def set_version(self, version: int) -> None:
        """Set the version locally and on every server (``/update_weight_version``),
        so tokens generated from now on report it."""
        self._control_all(lambda s: self.protocol.set_version(version))
        super().set_version(version)

    def init_weight_group_async(
        self, master_addr: str, master_port: int, group_name: str, backend: str
    ) -> list[concurrent.futures.Future]:
        # Every TP rank of every server joins: server i owns ranks 1 + i*tp .. (i+1)*tp.
        world = 1 + len(self.servers) * self.tp_size
        return [
            self._pool.submit(
                self._control, s,
                self.protocol.init_weight_group(master_addr, master_port, world, 1 + i * self.tp_size, group_name, backend),
            )
            for i, s in enumerate(self.servers)
        ]

    # -- in-memory updates (areal_sglang.weights.SGLangBroadcastTransport) ----------
    def _each_strict(self, make_call) -> list[Any]:
        """Like ``_control_all`` but every server must succeed: a collective
        weight update cannot leave one server behind."""
        futures = [self._pool.submit(self._control, s, make_call(s)) for s in self.servers]
        errors, results = [], []
        for f in futures:
            try:
                results.append(f.result())
            except ServerError as e:
                errors.append(str(e))
        if errors:
            raise ServerError("; ".join(errors))
        return results

    def begin_weight_update(self) -> None:
        self._each_strict(lambda s: self.protocol.begin_weight_update())

    def end_weight_update(self) -> None:
        self._each_strict(lambda s: self.protocol.end_weight_update())

    def update_bucket_async(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, version: int | None
    ) -> list[concurrent.futures.Future]:
        call = self.protocol.update_weights_bucket(names, dtypes, shapes, group_name, version)
        return [self._pool.submit(self._control, s, call) for s in self.servers]

    def destroy_weight_group(self, group_name: str) -> None:
        self._control_all(lambda s: self.protocol.destroy_weight_group(group_name))

    def note_version(self, version: int) -> None:
        """The servers already switched (the last bucket carried the version): local only."""
        super().set_version(version)

    def flush_cache(self) -> None:
        self._control_all(lambda s: self.protocol.flush_cache())

    def abort(self, rid: str | None = None) -> None:
        """Abort one request by id, or every running request on every server."""
        self._control_all(lambda s: self.protocol.abort_request(rid))

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free weights and/or KV cache (``tags``: "weights", "kv_cache") for a colocated trainer."""
        self._control_all(lambda s: self.protocol.release_memory(tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._control_all(lambda s: self.protocol.resume_memory(tags))


class SGLangBackend:
    """Built from the experiment config; the scheduler calls ``launch``."""

    def __init__(self, config: Any, launch_prefix: list[str] | None = None) -> None:
        self.config = config
        self.server_config: SGLangServerConfig = config.rollout.plugin_config or SGLangServerConfig()
        self.launch_prefix = launch_prefix
        self.launcher: Any = None
        self.tp_size = 1

    def launch(self, model_dir: str, device_plan: list[list[int]], run_dir: str) -> list[str]:
        from areal_sglang.launcher import SGLangLauncher

        self.launcher = SGLangLauncher(
            self.server_config, run_dir=run_dir, dtype=self.config.model.dtype, seed=self.config.seed,
            launch_prefix=self.launch_prefix,
        )
        per_server = len(device_plan[0]) if device_plan else 0
        self.tp_size = self.server_config.tp_size or max(1, per_server)
        infos = self.launcher.launch(model_dir, n_servers=max(1, len(device_plan)), devices_per_server=per_server)
        return [i.address for i in infos]

    def make_client(self, addresses: list[str]) -> SGLangInferenceEngine:
        r = self.config.rollout
        return SGLangInferenceEngine(
            addresses,
            SGLangProtocol(self.server_config.pause_mode),
            tp_size=self.tp_size,
            request_timeout_s=r.request_timeout_s,
            retries=r.request_retries,
            schedule_policy=r.schedule_policy,
            admin_token=self.server_config.api_key,
        )

    def stop(self) -> None:
        if self.launcher is not None:
            self.launcher.stop()
