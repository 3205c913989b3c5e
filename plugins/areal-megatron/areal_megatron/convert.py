"""HF <-> Megatron-Core weight conversion for Llama (SmolLM2), Qwen2 and Qwen3.

Megatron-Core's local layer spec (no Transformer Engine) names and lays out
a decoder's weights differently from HF:

- attention: one fused ``linear_qkv`` weight (and bias for Qwen2) whose rows
  are grouped by key/value head: for each KV group ``[q heads of the group,
  k head, v head]``; tensor parallelism splits whole groups;
- MLP: one fused ``linear_fc1`` = ``[gate; up]`` *per tensor-parallel rank*
  (each rank holds its slice of gate followed by its slice of up);
- column-parallel weights (qkv, fc1, vocab) split along rows, row-parallel
  ones (``linear_proj``, ``linear_fc2``) along columns; norms are replicated;
- a pipeline stage numbers its layers from 0 (``decoder.layers.<local>``);
  the global layer is ``offset + local``.

Conversion is per parameter so that a rank converts only what it holds and a
gather can stream: ``hf_to_megatron`` builds one rank's tensor for one
Megatron name from the HF tensors; ``megatron_to_hf`` turns the tensor-
parallel shards of one Megatron name back into HF tensors. Both only slice,
concatenate and reshape, so a round trip is bit-exact.

Pure torch (no megatron import): the conversion is testable without ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from areal_kernel.errors import ConfigError

SUPPORTED = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ArchSpec:
    """What the conversion and the Megatron model need from an HF config."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    eps: float
    max_positions: int

    @property
    def q_per_group(self) -> int:
        return self.heads // self.kv_heads


def arch_from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> ArchSpec:
    """``ArchSpec`` of an HF ``config.json`` (as a dict); ``ConfigError`` for
    an architecture the conversion does not know."""
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise ConfigError(
            f"{where}: model_type {mt!r} has no HF <-> Megatron conversion in areal-megatron; "
            f"supported: {', '.join(SUPPORTED)}"
        )
    rope = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ("default", None):
        raise ConfigError(f"{where}: rope scaling {rope_type!r} is not supported by areal-megatron (plain RoPE only)")
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(rope, dict):
        theta = rope.get("rope_theta")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if mt == "llama" and cfg.get("attention_bias"):
        raise ConfigError(f"{where}: Llama with attention_bias is not supported by areal-megatron")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias is not supported by areal-megatron")
    return ArchSpec(
        model_type=mt,
        layers=int(cfg["num_hidden_layers"]),
        hidden=hidden,
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        ffn=int(cfg["intermediate_size"]),
        vocab=int(cfg["vocab_size"]),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2",
        qk_norm=mt == "qwen3",
        rope_theta=float(theta if theta is not None else 10000.0),
        eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_positions=int(cfg.get("max_position_embeddings", 2048)),
    )


def check_layout(arch: ArchSpec, tp: int, pp: int, where: str = "actor.backend") -> None:
    """``ConfigError`` when the model cannot be split ``tp`` x ``pp`` ways."""
    problems = []
    if arch.heads % tp:
        problems.append(f"num_attention_heads={arch.heads} is not divisible by t={tp}")
    if arch.kv_heads % tp:
        problems.append(f"num_key_value_heads={arch.kv_heads} is not divisible by t={tp}")
    if arch.ffn % tp:
        problems.append(f"intermediate_size={arch.ffn} is not divisible by t={tp}")
    if arch.vocab % tp:
        problems.append(f"vocab_size={arch.vocab} is not divisible by t={tp}")
    if arch.layers % pp:
        problems.append(f"num_hidden_layers={arch.layers} is not divisible by p={pp}")
    if problems:
        raise ConfigError(f"{where}: this model cannot be split t={tp} p={pp}: " + "; ".join(problems))


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def megatron_names(arch: ArchSpec, n_local_layers: int, first: bool, last: bool) -> list[str]:
    """Megatron parameter names of one pipeline stage, in module order."""
    names = ["embedding.word_embeddings.weight"] if first else []
    for i in range(n_local_layers):
        p = f"decoder.layers.{i}."
        names.append(p + "input_layernorm.weight")
        names.append(p + "self_attention.linear_qkv.weight")
        if arch.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if arch.qk_norm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names.append(p + "self_attention.linear_proj.weight")
        names.append(p + "pre_mlp_layernorm.weight")
        names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    if last:
        names.append("decoder.final_layernorm.weight")
        if not arch.tied:
            names.append("output_layer.weight")
    return names


def _rows(t: Any, rank: int, size: int) -> Any:
    return t.chunk(size, dim=0)[rank]


def _cols(t: Any, rank: int, size: int) -> Any:
    return t.chunk(size, dim=1)[rank]


# Per-layer Megatron parameters that are one HF tensor as is (never split
# across tensor-parallel ranks): Megatron suffix -> HF suffix.
_SAME_SHAPE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


def _layer_parameter(name: str, layer_offset: int) -> tuple[str, str]:
    """``(HF prefix of its layer, Megatron suffix)`` of the per-layer parameter
    ``name`` (global layer = ``layer_offset`` + the stage-local number)."""
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")
    return f"model.layers.{int(m.group(1)) + layer_offset}.", m.group(2)


def hf_to_megatron(
    name: str, get: Callable[[str], Any], arch: ArchSpec, tp_rank: int, tp_size: int, layer_offset: int = 0
) -> Any:
    """Tensor-parallel rank ``tp_rank``'s tensor of the Megatron parameter
    ``name`` (stage-local layer numbering, global layer = ``layer_offset`` +
    local), built from HF tensors fetched with ``get(hf_name)``."""
    import torch

    if name == "embedding.word_embeddings.weight":
        return _rows(get("model.embed_tokens.weight"), tp_rank, tp_size).clone()
    if name == "output_layer.weight":
        return _rows(get("lm_head.weight"), tp_rank, tp_size).clone()
    if name == "decoder.final_layernorm.weight":
        return get("model.norm.weight").clone()
    hf, rest = _layer_parameter(name, layer_offset)
    if rest in _SAME_SHAPE:
        return get(hf + _SAME_SHAPE[rest]).clone()
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        g, d = arch.kv_heads, arch.head_dim
        q = get(hf + f"self_attn.q_proj.{kind}").reshape(g, arch.q_per_group * d, -1)
        k = get(hf + f"self_attn.k_proj.{kind}").reshape(g, d, -1)
        v = get(hf + f"self_attn.v_proj.{kind}").reshape(g, d, -1)
        fused = torch.cat([q, k, v], dim=1)  # [groups, (q_per_group + 2) * d, H or 1]
        part = _rows(fused, tp_rank, tp_size)
        out = part.reshape(-1, part.shape[-1])
        return (out[:, 0] if kind == "bias" else out).clone()
    if rest == "self_attention.linear_proj.weight":
        return _cols(get(hf + "self_attn.o_proj.weight"), tp_rank, tp_size).clone()
    if rest == "mlp.linear_fc1.weight":
        gate = _rows(get(hf + "mlp.gate_proj.weight"), tp_rank, tp_size)
        up = _rows(get(hf + "mlp.up_proj.weight"), tp_rank, tp_size)
        return torch.cat([gate, up], dim=0)
    if rest == "mlp.linear_fc2.weight":
        return _cols(get(hf + "mlp.down_proj.weight"), tp_rank, tp_size).clone()
    raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")


def megatron_to_hf(name: str, shards: list[Any], arch: ArchSpec, layer_offset: int = 0) -> list[tuple[str, Any]]:
    """HF ``(name, tensor)`` pairs of the Megatron parameter ``name`` from its
    tensor-parallel shards (rank order; replicated parameters: any one)."""
    import torch

    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", torch.cat(shards, dim=0))]
    if name == "output_layer.weight":
        return [("lm_head.weight", torch.cat(shards, dim=0))]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    hf, rest = _layer_parameter(name, layer_offset)
    if rest in _SAME_SHAPE:
        return [(hf + _SAME_SHAPE[rest], shards[0])]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        g, d, qg = arch.kv_heads, arch.head_dim, arch.q_per_group
        full = torch.cat(shards, dim=0)
        cols = full.shape[1] if kind == "weight" else 1
        grouped = full.reshape(g, (qg + 2) * d, cols)
        q, k, v = grouped.split([qg * d, d, d], dim=1)
        out = []
        for proj, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            t = t.reshape(-1, cols)
            out.append((hf + f"self_attn.{proj}.{kind}", t[:, 0].contiguous() if kind == "bias" else t.contiguous()))
        return out
    if rest == "self_attention.linear_proj.weight":
        return [(hf + "self_attn.o_proj.weight", torch.cat(shards, dim=1))]
    if rest == "mlp.linear_fc1.weight":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return [(hf + "mlp.gate_proj.weight", gate), (hf + "mlp.up_proj.weight", up)]
    if rest == "mlp.linear_fc2.weight":
        return [(hf + "mlp.down_proj.weight", torch.cat(shards, dim=1))]
    raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")


def is_tensor_parallel(name: str) -> bool:
    """Whether the Megatron parameter ``name`` is split across tensor-parallel
    ranks (else every rank holds the same copy)."""
    return not name.endswith("layernorm.weight")
