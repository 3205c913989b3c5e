"""Vision-language models: which families run, and their image inputs as tensors.

One place turns a prompt's ``ImageInputs`` (encoded image files) into the
keyword tensors a model's forward takes, for the embedded server and for the
train engines, so the server's logprobs and the engine's recompute see the
same pixels.

Supported family: Idefics3 / SmolVLM (``model_type`` ``idefics3`` or
``smolvlm``). Its positions are plain 1-D positions and an image's features
depend on that image alone, so a prompt's image placeholder tokens can be
packed with other sequences and batched with other rows exactly: the model
replaces the placeholder tokens of a forward, in order, by the features of the
images handed to it in the same order. Qwen2-VL-style models (3-D rotary
positions computed from the image grid) are not supported yet: they are
rejected by name.

``import areal_kernel.models.vision`` does not import torch; the functions do.
"""

from __future__ import annotations

import io
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from areal_kernel.api.io import ImageInputs
from areal_kernel.errors import ConfigError, DataError

SUPPORTED_FAMILIES = ("idefics3", "smolvlm")
# Families transformers ships that need more than this module does (3-D positions).
_KNOWN_UNSUPPORTED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "mllama", "gemma3")


def model_family(model_path: str) -> str | None:
    """The ``model_type`` of a vision-language model directory, else None (a text model)."""
    path = os.path.join(model_path, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None
    if "vision_config" not in cfg:
        return None
    return str(cfg.get("model_type", "?"))


def is_vision_model(model_path: str) -> bool:
    return model_family(model_path) is not None


def check_supported(model_path: str) -> str:
    """The family of a vision-language model directory; ``ConfigError`` for one this kernel cannot run."""
    family = model_family(model_path)
    if family is None:
        raise ConfigError(f"{model_path} is not a vision-language model (its config.json has no vision_config)")
    if family not in SUPPORTED_FAMILIES:
        hint = " (3-D rotary positions are not supported yet)" if family in _KNOWN_UNSUPPORTED else ""
        raise ConfigError(
            f"vision-language model family {family!r} in {model_path} is not supported{hint}; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return family


def load_model(model_path: str, dtype: Any, attn_implementation: str) -> Any:
    """The HF model of a vision-language directory (image-text-to-text head)."""
    from transformers import AutoModelForImageTextToText

    check_supported(model_path)
    return AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype, attn_implementation=attn_implementation)


def decode_image(data: bytes, where: str) -> Any:
    """A PIL RGB image from encoded bytes; ``DataError`` naming ``where`` when they are not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
    return img.convert("RGB")


class ImageTensors:
    """Image files -> the forward's image keyword tensors, for one model directory.

    ``pixels(images)``: ``{"pixel_values": [N, 3, H, W], "pixel_attention_mask":
    [N, H, W]}`` for one prompt's N images (cached by digest: the samples of a
    prompt decode their images once). ``batch([...])``: the keywords of one
    forward over several sequences / rows, images concatenated in sequence
    order (the order the model fills placeholder tokens in)."""

    def __init__(self, model_path: str, *, cache_size: int = 256) -> None:
        from transformers import AutoConfig, AutoImageProcessor

        check_supported(model_path)
        self.model_path = model_path
        self.config = AutoConfig.from_pretrained(model_path)
        self.image_token_id = int(self.config.image_token_id)
        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self._cache: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._cache_size = cache_size

    def count_placeholders(self, input_ids: Sequence[int]) -> int:
        return sum(1 for t in input_ids if t == self.image_token_id)

    def pixels(self, images: ImageInputs, where: str = "request") -> dict[str, Any]:
        hit = self._cache.get(images.digest)
        if hit is not None:
            self._cache.move_to_end(images.digest)
            return hit
        pil = [decode_image(f, f"{where}: image {i}") for i, f in enumerate(images.files)]
        out = self.processor(images=[[im] for im in pil], return_tensors="pt")
        pv = out["pixel_values"]
        pm = out.get("pixel_attention_mask")
        # [prompts, images per prompt, ...] -> [images, ...]
        res = {"pixel_values": pv.reshape(-1, *pv.shape[-3:])}
        if pm is not None:
            res["pixel_attention_mask"] = pm.reshape(-1, *pm.shape[-2:])
        self._cache[images.digest] = res
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return res

    def batch(self, per_seq: Sequence[ImageInputs | None], dtype: Any, device: Any) -> dict[str, Any]:
        """Keywords for one forward whose sequences have ``per_seq`` images ({} when none has)."""
        import torch

        parts = [self.pixels(im) for im in per_seq if im is not None]
        if not parts:
            return {}
        shapes = {tuple(p["pixel_values"].shape[-2:]) for p in parts}
        if len(shapes) > 1:
            raise DataError(
                f"images of one forward were processed to different sizes {sorted(shapes)}; "
                "the image processor must resize every image to one size (do_image_splitting off)"
            )
        out = {"pixel_values": torch.cat([p["pixel_values"] for p in parts])[None].to(device=device, dtype=dtype)}
        if all("pixel_attention_mask" in p for p in parts):
            out["pixel_attention_mask"] = torch.cat([p["pixel_attention_mask"] for p in parts])[None].to(device)
        return out

    def blank_kwargs(self, dtype: Any, device: Any) -> dict[str, Any]:
        """Image keywords of one blank image, for a forward without image tokens:
        the vision tower runs and gets zero gradients (its features fill no
        placeholder). Distributed engines need it: ranks must reduce the same
        gradients, whether or not their micro-batch had images."""
        import torch

        side = int(self.config.vision_config.image_size)
        return {
            "pixel_values": torch.ones(1, 1, 3, side, side, dtype=dtype, device=device),
            "pixel_attention_mask": torch.ones(1, 1, side, side, dtype=torch.bool, device=device),
        }

    def tokens_per_image(self) -> int:
        """Placeholder tokens one image expands to (Idefics3 without image splitting)."""
        v = self.config.vision_config
        return int((v.image_size // v.patch_size) ** 2 // (self.config.scale_factor**2))


@dataclass(frozen=True)
class ImagePlaceholders:
    """How the processor of a model expands one image in the token ids, for
    backends whose servers expand images themselves from a prompt holding one
    image token per image (vLLM): ``collapse`` turns the kernel's token ids
    (expanded, what the train engine and the embedded server take) into that
    form. The server expands them back to exactly the same ids.

    Idefics3 without image splitting: ``before`` = (``<fake_token_around_image>``,
    ``<global-img>``), ``tokens_per_image`` x ``<image>``, ``after`` =
    (``<fake_token_around_image>``,)."""

    image_token_id: int
    tokens_per_image: int
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()

    def collapse(self, ids: Sequence[int]) -> list[int]:
        out: list[int] = []
        i, n, img = 0, len(ids), self.image_token_id
        nb, na = len(self.before), len(self.after)
        while i < n:
            if ids[i] != img:
                out.append(ids[i])
                i += 1
                continue
            j = i
            while j < n and ids[j] == img:
                j += 1
            run = j - i
            if run % self.tokens_per_image:
                raise DataError(
                    f"token ids hold a run of {run} image tokens at position {i}; an image is "
                    f"{self.tokens_per_image} tokens (render prompts with the model's processor)"
                )
            if nb and out[-nb:] == list(self.before):
                del out[-nb:]
            out.extend([img] * (run // self.tokens_per_image))
            if na and list(ids[j : j + na]) == list(self.after):
                j += na
            i = j
        return out


def image_placeholders(model_path: str) -> ImagePlaceholders | None:
    """The placeholder layout of a vision-language model directory (None for a text model)."""
    family = model_family(model_path)
    if family is None:
        return None
    check_supported(model_path)
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    v = cfg.get("vision_config", {})
    per_image = int((v.get("image_size", 364) // v.get("patch_size", 14)) ** 2 // (cfg.get("scale_factor", 2) ** 2))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    fake = int(tok.convert_tokens_to_ids("<fake_token_around_image>"))  # type: ignore[arg-type]
    glob = int(tok.convert_tokens_to_ids("<global-img>"))  # type: ignore[arg-type]
    return ImagePlaceholders(int(cfg["image_token_id"]), per_image, (int(fake), int(glob)), (int(fake),))


def image_data_url(data: bytes) -> str:
    """A ``data:`` URL of an encoded image file (the media type sniffed from its first bytes)."""
    import base64

    kinds = (
        (b"\x89PNG", "image/png"),
        (b"\xff\xd8\xff", "image/jpeg"),
        (b"GIF8", "image/gif"),
        (b"RIFF", "image/webp"),
    )
    mime = next((m for sig, m in kinds if data.startswith(sig)), "application/octet-stream")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
