"""The few megatron-core calls that hard-code CUDA, redirected for the cpu platform.

megatron-core assumes a CUDA device in a handful of places that the local
(no Transformer Engine) GPT path reaches. On the ``cpu`` platform (CI on gloo)
``apply()`` replaces exactly those functions with host-memory equivalents;
on any other platform it does nothing, so CUDA runs megatron-core unmodified.

Every entry names the megatron-core function it replaces and the
megatron-core versions it was checked against; ``apply()`` refuses a version
outside ``CHECKED`` (the replaced code may have changed) instead of patching
blindly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from areal_kernel.errors import ConfigError

# megatron-core versions whose source of every replaced function was read.
CHECKED = ("0.16.1",)


@dataclass(frozen=True)
class Redirect:
    """One replaced megatron-core function."""

    target: str  # "module:attr" or "module:Class.attr" of megatron-core
    why: str  # the CUDA call it contains
    make: Callable[[Any], Any]  # original -> replacement
    checked: tuple[str, ...] = CHECKED  # megatron-core releases whose source of ``target`` was read


def _noop_cuda_seed(original: Any) -> Any:
    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        # The CUDA RNG tracker forks per-TP-rank CUDA generators; on host
        # memory there is one CPU generator and the engine seeds it itself.
        # Dropout is 0 in the engine's config, so no tracked RNG is consumed.
        import torch

        torch.manual_seed(seed)

    return model_parallel_cuda_manual_seed


def _fork_without_cuda_states(original: Any) -> Any:
    import contextlib

    @contextlib.contextmanager
    def fork(self: Any, name: str = "model-parallel-rng") -> Any:
        # The tracker swaps torch.cuda generator states around the block; on
        # host memory there are none (the seed above adds none), so the block
        # runs on the process's CPU generator.
        yield

    return fork


def _rope_emb_on_host(original: Any) -> Any:
    def get_emb(self: Any, max_seq_len: int, offset: int = 0) -> Any:
        # Same computation as megatron-core's, without the move of inv_freq
        # to torch.cuda.current_device().
        import torch

        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    return get_emb


def _causal_mask_on_host(original: Any) -> Any:
    def get_default_causal_mask(sq: int) -> Any:
        import torch

        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    return get_default_causal_mask


def _memory_buffer_on_host(original: Any) -> Any:
    def get_tensor(self: Any, tensor_shape: Any, dtype: Any, name: str, mem_alloc_context: Any = None) -> Any:
        # Same reuse-by-name buffer, allocated in host memory instead of on
        # torch.cuda.current_device() (the attention matmul's scratch input).
        import math

        import torch

        need = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < need:
            buf = self.buffer[(name, dtype)] = torch.empty(need, dtype=dtype, requires_grad=False)
        return buf[0:need].view(*tensor_shape)

    return get_tensor


def _tied_embedding_setup_on_host(original: Any) -> Any:
    def setup_embeddings_and_output_layer(self: Any) -> None:
        # megatron-core moves the tied embedding's last-stage copy with
        # ``weight.data.cuda()`` before the first/last-stage all-reduce; on
        # host memory the copy stays where it is for the duration of the call.
        import torch

        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign]
        try:
            original(self)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    return setup_embeddings_and_output_layer


def _preload_without_cuda_sync(original: Any) -> Any:
    def preload_tensors(write_buckets: Any, non_blocking: bool = True) -> Any:
        # The checkpoint writer copies tensors to host memory, then waits with
        # torch.cuda.synchronize(); host tensors need neither copy nor wait.
        return original(write_buckets, False)

    return staticmethod(preload_tensors)


def _checkpoint_call_on_host(original: Any) -> Any:
    import functools

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        # dist_checkpointing's torch_dist strategy makes its coordination
        # tensors on torch.cuda.current_device() and waits with
        # torch.cuda.synchronize() (state_dict_saver, async_utils). For the
        # duration of this call only, the current device is the host and
        # there is nothing to wait for.
        import torch

        cur, sync = torch.cuda.current_device, torch.cuda.synchronize
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.current_device, torch.cuda.synchronize = cur, sync  # type: ignore[assignment]

    return call


REDIRECTS: tuple[Redirect, ...] = (
    Redirect(
        "megatron.core.tensor_parallel.random:model_parallel_cuda_manual_seed",
        "initialises per-rank torch.cuda generators",
        _noop_cuda_seed,
    ),
    Redirect(
        "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork",
        "swaps torch.cuda generator states around tensor-parallel regions",
        _fork_without_cuda_states,
    ),
    Redirect(
        "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb",
        "moves inv_freq to torch.cuda.current_device()",
        _rope_emb_on_host,
    ),
    Redirect(
        "megatron.core.transformer.utils:get_default_causal_mask",
        'builds the mask with device="cuda"',
        _causal_mask_on_host,
    ),
    Redirect(
        "megatron.core.fusions.fused_softmax:get_default_causal_mask",
        "the same function, imported by name into the softmax module",
        _causal_mask_on_host,
    ),
    Redirect(
        "megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
        "moves the tied embedding of the last pipeline stage with .cuda()",
        _tied_embedding_setup_on_host,
    ),
    Redirect(
        "megatron.core.dist_checkpointing:save",
        "its torch_dist strategy uses torch.cuda.current_device() and torch.cuda.synchronize()",
        _checkpoint_call_on_host,
    ),
    Redirect(
        "megatron.core.dist_checkpointing:load",
        "the same strategy's load side",
        _checkpoint_call_on_host,
    ),
    Redirect(
        "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.preload_tensors",
        "calls torch.cuda.synchronize() after copying the tensors to host memory",
        _preload_without_cuda_sync,
    ),
    Redirect(
        "megatron.core.utils:GlobalMemoryBuffer.get_tensor",
        "allocates its buffer on torch.cuda.current_device()",
        _memory_buffer_on_host,
    ),
)

_applied: list[str] = []


def applied() -> list[str]:
    """Targets redirected in this process (empty on a non-cpu platform)."""
    return list(_applied)


def apply(host_memory: bool | None = None) -> list[str]:
    """Redirect every entry of ``REDIRECTS`` when the platform computes in host
    memory (``Platform.host_memory``: the cpu platform); idempotent. Returns
    the redirected targets. On an accelerator nothing is touched."""
    import importlib

    if host_memory is None:
        from areal_kernel.platforms import current_platform

        host_memory = current_platform().host_memory
    if not host_memory or _applied:
        return applied()
    from importlib.metadata import version

    v = version("megatron-core")
    if any(v not in r.checked for r in REDIRECTS):
        raise ConfigError(
            f"megatron-core {v} is installed, but the cpu redirects of areal-megatron were checked against "
            f"{', '.join(CHECKED)} only; install megatron-core=={CHECKED[-1]} (areal-megatron[cpu])"
        )
    for r in REDIRECTS:
        mod_name, _, attr = r.target.partition(":")
        owner: Any = importlib.import_module(mod_name)
        *path, leaf = attr.split(".")
        for p in path:
            owner = getattr(owner, p)
        setattr(owner, leaf, r.make(getattr(owner, leaf)))
        _applied.append(r.target)
    return applied()
