"""LoRA adapters in the torch-based train engines (built with ``peft``).

One place for what every engine that trains an adapter does the same way
(the built-in ``TorchTrainEngine`` and areal-fsdp's ranks): wrapping the HF
model, the adapter's tensors under the names peft saves them with (what
``PeftModel.from_pretrained``, vLLM and SGLang load, and what the kernel's
weight transports send), the ``adapter_config.json`` beside them, the
adapter directory writer and the merged export.

Adapter tensor names are peft's file names:
``base_model.model.<module path>.lora_A.weight`` (shape ``[r, in]``) and
``...lora_B.weight`` (``[out, r]``); the update of that module's output is
``(x @ A.T) @ B.T * alpha / r``.
"""

from __future__ import annotations

import enum
import json
import os
from typing import TYPE_CHECKING, Any

from areal_kernel.errors import ConfigError, DataError
from areal_kernel.utils.fs import atomic_dir

if TYPE_CHECKING:
    from areal_kernel.engine.config import LoraConfig

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def check_targets(model: Any, lora: "LoraConfig", section: str) -> None:
    """``ConfigError`` naming ``section`` when a target module of ``lora`` does
    not exist in the (not yet wrapped) ``model`` or is not a linear layer."""
    import torch

    names = [n for n, _ in model.named_modules()]
    for target in lora.target_modules:
        hits = [n for n in names if n == target or n.endswith("." + target)]
        if not hits:
            raise ConfigError(
                f"{section}.target_modules: no module of the model is named {target!r} "
                f"(e.g. valid: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
            )
        bad = [n for n in hits if not isinstance(model.get_submodule(n), torch.nn.Linear)]
        if bad:
            raise ConfigError(f"{section}.target_modules: {target!r} matches {bad[0]!r}, which is not a linear layer")


def peft_lora_config(lora: "LoraConfig") -> Any:
    """The ``peft.LoraConfig`` of the kernel's ``lora``."""
    import peft

    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: Any, lora: "LoraConfig", section: str = "actor.<engine>.lora") -> Any:
    """Wrap the HF causal LM ``model`` in a peft model with one adapter; the
    base weights are frozen. ``ConfigError`` naming ``section`` when a target
    module does not exist or is not a linear layer."""
    import peft

    check_targets(model, lora, section)
    return peft.get_peft_model(model, peft_lora_config(lora))


def peft_adapter_name(index: int) -> str:
    """The name of the ``index``-th of several adapters inside the peft model.
    Not the policy's name: that may hold dots, which module paths cannot."""
    return f"adapter{index}"


def apply_adapters(model: Any, loras: "list[LoraConfig]", section: str = "actor.<engine>.adapters") -> Any:
    """Wrap the HF causal LM ``model`` in a peft model with one adapter per
    entry of ``loras`` (peft names ``peft_adapter_name(i)``), the base frozen
    and shared; the first adapter is active. Every entry's targets are
    checked before anything is wrapped; ``ConfigError`` names the entry
    (``section[i] (name 'x')``) and the field."""
    import peft

    for i, lora in enumerate(loras):
        check_targets(model, lora, f"{section}[{i}] (name {lora.name!r})")
    wrapped = peft.get_peft_model(model, peft_lora_config(loras[0]), adapter_name=peft_adapter_name(0))
    for i, lora in enumerate(loras[1:], start=1):
        wrapped.add_adapter(peft_adapter_name(i), peft_lora_config(lora))
    wrapped.set_adapter(peft_adapter_name(0))
    return wrapped


def adapter_params(model: Any, adapter: str) -> list[tuple[str, Any]]:
    """``(peft file name, live parameter)`` of the adapter ``adapter`` of the
    peft ``model``, in model order, whether it trains right now or not (peft
    switches ``requires_grad`` with the active adapter)."""
    marks = [(f".lora_A.{adapter}.", ".lora_A."), (f".lora_B.{adapter}.", ".lora_B.")]
    out = []
    for n, p in model.named_parameters():
        for live, file in marks:
            if live in n:
                out.append((n.replace(live, file), p))
    return out


def is_peft_model(model: Any) -> bool:
    import peft

    return isinstance(model, peft.PeftModel)


def trainable_named_params(model: Any) -> list[tuple[str, Any]]:
    """``(live name, parameter)`` of every parameter that trains, in model order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def peft_file_name(live_name: str) -> str:
    """The name peft saves an adapter parameter under, from its live name
    (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``)."""
    return live_name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def adapter_weights(model: Any, adapter: str = "default") -> list[tuple[str, Any]]:
    """``(peft file name, tensor)`` of the adapter ``adapter`` of the peft
    ``model``, in module order; detached views of the live tensors, not copies."""
    import peft

    return [(n, t.detach()) for n, t in peft.get_peft_model_state_dict(model, adapter_name=adapter).items()]


def _json_safe(x: Any) -> Any:
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, (set, frozenset)):
        return sorted(_json_safe(v) for v in x)
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def adapter_config(model: Any, base_model_path: str | None = None, adapter: str = "default") -> dict[str, Any]:
    """The ``adapter_config.json`` of the peft ``model``'s adapter ``adapter`` (JSON data)."""
    cfg = _json_safe(model.peft_config[adapter].to_dict())
    cfg["inference_mode"] = True
    if base_model_path is not None:
        cfg["base_model_name_or_path"] = base_model_path
    return cfg


def write_adapter_files(directory: str, named: list[tuple[str, Any]], config: dict[str, Any]) -> int:
    """The two files of a peft adapter directory into the existing ``directory``;
    returns the bytes of the tensors."""
    from safetensors.torch import save_file

    tensors = {n: t.detach().to("cpu").contiguous() for n, t in named}
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=1)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_adapter_dir(path: str, named: list[tuple[str, Any]], config: dict[str, Any]) -> int:
    """Write a peft adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) at ``path``, atomically; returns the bytes
    of the tensors written."""
    with atomic_dir(path) as tmp:
        return write_adapter_files(tmp, named, config)


def read_adapter_dir(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(adapter_config, {peft name: tensor})`` of a peft adapter directory on
    the host; ``DataError`` naming the file when one is missing or unreadable."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, ADAPTER_CONFIG_FILE)
    w_path = os.path.join(path, ADAPTER_WEIGHTS_FILE)
    for p in (cfg_path, w_path):
        if not os.path.isfile(p):
            raise DataError(f"{path!r} is not a peft adapter directory (no {os.path.basename(p)})")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except ValueError as e:
        raise DataError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise DataError(f"{cfg_path}: must hold a JSON object")
    return cfg, load_file(w_path)


def merge_plan(model: Any, adapter: str = "default") -> list[tuple[str, str, tuple[str, str, float] | None]]:
    """How a merged export is built from the peft ``model``'s live state dict
    (with its adapter ``adapter``; other adapters are left out),
    without computing anything: ``(HF name, live base name, (live A name,
    live B name, scale) or None)`` per weight of the base model, tied aliases
    dropped. A distributed engine gathers the live names of one entry at a
    time and merges like ``merge_tensor``."""
    from peft.tuners.lora import LoraLayer

    from areal_kernel.engine.hf import weights_for_transfer

    lora_of: dict[str, tuple[str, str, float]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and adapter in mod.lora_A:
            lora_of[f"{name}.base_layer.weight"] = (
                f"{name}.lora_A.{adapter}.weight",
                f"{name}.lora_B.{adapter}.weight",
                float(mod.scaling[adapter]),
            )
    plan = []
    for live, _ in weights_for_transfer(model):
        if ".lora_A." in live or ".lora_B." in live:
            continue
        hf = live.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        plan.append((hf, live, lora_of.get(live)))
    return plan


def merge_tensor(base: Any, a: Any | None, b: Any | None, scale: float) -> Any:
    """``base + scale * b @ a`` in ``base``'s dtype (``base`` when there is no adapter)."""
    if a is None or b is None:
        return base
    return base + (b.float() @ a.float() * scale).to(base.dtype)


def merged_weights(model: Any, adapter: str = "default") -> list[tuple[str, Any]]:
    """The base model's weights with the adapter merged in (``W + scale * B @ A``
    for every adapted layer), under the base model's HF names, tied aliases
    dropped; the live model is left untouched (nothing is merged in place)."""
    import torch

    sd = model.state_dict()
    out: list[tuple[str, Any]] = []
    with torch.no_grad():
        for hf, live, lora in merge_plan(model, adapter):
            t = sd[live].detach()
            if lora is not None:
                t = merge_tensor(t, sd[lora[0]], sd[lora[1]], lora[2])
            out.append((hf, t))
    return out


def save_merged_hf_dir(path: str, model: Any, source_dir: str | None, adapter: str = "default") -> None:
    """An HF directory of the base model with the adapter ``adapter`` merged in
    (``merged_weights``), written like every other export."""
    from areal_kernel.engine.hf import finish_hf_dir, write_hf_weights

    named = merged_weights(model, adapter)
    with atomic_dir(path) as tmp:
        files = {"model.safetensors": write_hf_weights(tmp, "model.safetensors", named)}
        finish_hf_dir(tmp, model.get_base_model(), files, source_dir)


def save_adapter_hf_dir(
    path: str, named: list[tuple[str, Any]], config: dict[str, Any], source_dir: str | None
) -> None:
    """A peft adapter directory plus the source model's tokenizer files (what
    ``PeftModel.from_pretrained(base, path)`` and the serving engines load).
    The base model's ``config.json`` is left out: with it the directory would
    look like a full model without weights."""
    with atomic_dir(path) as tmp:
        write_adapter_files(tmp, named, config)
        copy_tokenizer_files(source_dir, tmp)


def copy_tokenizer_files(source_dir: str | None, directory: str) -> None:
    """The source model's tokenizer and chat template files into an adapter directory."""
    import shutil

    if not source_dir or not os.path.isdir(source_dir):
        return
    for name in os.listdir(source_dir):
        src = os.path.join(source_dir, name)
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(directory, name))
