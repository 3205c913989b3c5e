"""Fault injectors, driven by the environment (rewards run in worker
processes that inherit it) or by ``algorithm.fault_nan_ppo`` (the loss's settings).

``AREAL_FAULT_DIR``: a directory shared by the test and every reward worker.
Each reward call appends ``<answer> <outcome>`` to ``calls.log`` there, so the
test can count what the kernel should have counted. ``hang_first_reward``
claims the first ``AREAL_FAULT_HANGS`` calls with marker files created with
O_EXCL (atomic across worker processes and restarts).
"""

from __future__ import annotations

import dataclasses
import os
import time

from pydantic import BaseModel, ConfigDict

from areal_kernel.trainer.weight_sync import DiskTransport
from areal_kernel.workflow.rlvr import RLVRWorkflow


class NanLossSettings(BaseModel):
    """``algorithm.fault_nan_ppo``."""

    model_config = ConfigDict(extra="forbid")
    nan_steps: list[int] = []


def _log(answer: str, outcome: str) -> None:
    d = os.environ.get("AREAL_FAULT_DIR")
    if d:
        # One short O_APPEND write per line: lines from concurrent workers do not interleave.
        with open(os.path.join(d, "calls.log"), "a", encoding="utf-8") as f:
            f.write(f"{answer} {outcome}\n")


def raise_some_reward(completion: str, answer: str, **kwargs) -> float:
    if int(answer) % 4 == 3:
        _log(answer, "raise")
        raise ValueError(f"injected reward failure for answer {answer}")
    _log(answer, "ok")
    return 1.0


def always_raise_reward(completion: str, answer: str, **kwargs) -> float:
    _log(answer, "raise")
    raise RuntimeError("injected reward failure (always)")


def spread_reward(completion: str, answer: str, **kwargs) -> float:
    """Different completions get different rewards, so every GRPO group has
    non-zero advantages and every applied step changes the weights."""
    import zlib

    return (zlib.crc32(completion.encode("utf-8")) % 1000) / 1000.0


def _claim_hang() -> bool:
    d = os.environ["AREAL_FAULT_DIR"]
    for i in range(int(os.environ.get("AREAL_FAULT_HANGS", "0"))):
        try:
            os.close(os.open(os.path.join(d, f"hang{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            continue
    return False


def hang_first_reward(completion: str, answer: str, **kwargs) -> float:
    if _claim_hang():
        _log(answer, "hang")
        time.sleep(3600)  # far past reward.timeout_s: the pool must kill this worker
    _log(answer, "ok")
    return 1.0


_step = {"n": 0, "marker": None}


def nan_ppo_loss(logprobs, data, *, nan_steps, knobs, **kwargs):
    """The built-in ppo loss, times NaN on the (1-based) training steps in
    ``nan_steps``. A step is one ``train_batch`` call: every micro-batch of a
    call shares the same ``batch_loss_tokens`` tensor object (held here, so
    a new call's tensor cannot be mistaken for it)."""
    from areal_kernel.algo.losses import ppo_actor_loss

    marker = data.get("batch_loss_tokens")
    if marker is not _step["marker"]:
        _step["marker"] = marker
        _step["n"] += 1
    loss, stats = ppo_actor_loss(logprobs, data, knobs=knobs, **kwargs)
    if _step["n"] in set(nan_steps):
        loss = loss * float("nan")
    return loss, stats


class HotSamplerSettings(BaseModel):
    """``workflow.fault_hot_rlvr``."""

    model_config = ConfigDict(extra="forbid")
    temperature_factor: float = 2.0


class HotSamplerWorkflow(RLVRWorkflow):
    """The built-in rlvr workflow, but the servers are asked to sample at
    another temperature than the run's (the trainer scores with the
    configured one): the silent fault the mismatch monitor must catch."""

    @classmethod
    def from_context(cls, context):
        factor = context.settings.temperature_factor
        hot = dataclasses.replace(context.gconfig, temperature=context.gconfig.temperature * factor)
        return cls(
            tokenizer=context.tokenizer, gconfig=hot, reward_target=context.reward.target,
            reward_pool=context.reward_pool,
        )  # fmt: skip


def _corrupt_in_place(path: str, tensor: str) -> None:
    """Flip the lowest mantissa bit of every element of ``tensor`` in the
    safetensors file of ``path`` that holds it: a change of one ulp, far
    below anything generation would show, that only an exact check sees."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from areal_kernel.weights.disk import list_safetensors_files

    for fpath in list_safetensors_files(path):
        with safe_open(fpath, framework="pt") as f:
            if tensor not in f.keys():
                continue
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        t = tensors[tensor].contiguous()
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        tensors[tensor] = (t.view(ints) ^ 1).view(t.dtype)
        save_file(tensors, fpath, metadata=meta)
        return
    raise AssertionError(f"fault: no tensor {tensor!r} under {path}")


class CorruptingDiskTransport(DiskTransport):
    """The built-in disk transport with a fault between the trainer's write
    and the servers' load: ``AREAL_FAULT_CORRUPT=<version>:<tensor>`` changes
    that tensor of that version's update (``none``: a clean pass-through, the
    negative control). Each corruption is logged to ``corrupted.log``.
    ``AREAL_FAULT_STALE=<version>``: at that update the last server is only
    told the new version and keeps serving the weights it had (a weight
    sync that did not land); with LoRA, the adapter update never reaches it
    and it keeps the adapter's previous version. Logged to ``stale.log``."""

    name = "fault_corrupt_disk"

    def __init__(self, train_engine, infer_engine, run_dir, bucket_bytes=0):
        super().__init__(_CorruptingSender(train_engine), _StaleServer(infer_engine), run_dir, bucket_bytes)


class _StaleServer:
    """The inference engine, except that the update of ``AREAL_FAULT_STALE``
    reaches every server but the last, which gets only the version label."""

    def __init__(self, engine):
        self._engine = engine
        spec = os.environ.get("AREAL_FAULT_STALE", "none")
        self._version = None if spec == "none" else int(spec)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def update_weights(self, meta):
        e = self._engine
        if meta.version != self._version or meta.kind != "disk":
            return e.update_weights(meta)
        *fresh, stale = [s.address for s in e.servers]
        if meta.adapter is not None:
            # An adapter update that never reaches the last server: it keeps
            # serving the adapter's previous version. The client records what
            # it sent, as its own load_adapter does (a check that reads which
            # directory a server serves, SGLang's, compares with that record).
            e._record_adapter(meta.adapter, meta.path, meta.version)
            for address in fresh:
                e.control(address, e.protocol.load_adapter(meta.adapter, meta.path, meta.version, True))
            e.set_version(meta.version)
        else:
            for address in fresh:
                e.control(address, e.protocol.update_weights_from_disk(meta.path, meta.version))
            e.control(stale, e.protocol.set_version(meta.version))
            e.set_version(meta.version)
        d = os.environ.get("AREAL_FAULT_DIR")
        if d:
            with open(os.path.join(d, "stale.log"), "a", encoding="utf-8") as f:
                f.write(f"{meta.version} {stale}\n")


class _CorruptingSender:
    """The train engine, except that ``send_weights`` corrupts the directory it wrote."""

    def __init__(self, engine):
        self._engine = engine
        spec = os.environ.get("AREAL_FAULT_CORRUPT", "none")
        self._fault = None if spec == "none" else (int(spec.split(":", 1)[0]), spec.split(":", 1)[1])

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def send_weights(self, meta):
        self._engine.send_weights(meta)
        if self._fault is not None and meta.version == self._fault[0]:
            _corrupt_in_place(meta.path, self._fault[1])
            d = os.environ.get("AREAL_FAULT_DIR")
            if d:
                with open(os.path.join(d, "corrupted.log"), "a", encoding="utf-8") as f:
                    f.write(f"{meta.version} {self._fault[1]}\n")
