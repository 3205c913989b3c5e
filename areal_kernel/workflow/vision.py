"""Vision RLVR: prompts with images -> n samples -> verifiable reward.

``workflow.type: vision_rlvr`` reads records with ``prompt``, ``answer`` and
``images`` (``areal_kernel.data.images``). The prompt is rendered with the
model's processor and its chat template: the user message holds the images
(where the prompt's ``<image>`` markers are, else before the text) and the
text; the processor expands every image into the model's placeholder tokens.
The images are read once per episode into one ``ImageInputs`` that every
sample's request, response and trajectory share by reference.

``VisionPromptEncoder`` is the one renderer of such prompts: the offline SFT
trainer uses it too, so a supervised prompt is token for token what the
servers see during RL.
"""

from __future__ import annotations

from typing import Any

from areal_kernel.api.io import ImageInputs
from areal_kernel.data.images import IMAGE_MARKER, record_images, record_label
from areal_kernel.errors import ConfigError, DataError
from areal_kernel.workflow.rlvr import RLVRWorkflow, fill_prompt_template
from areal_kernel.workflow.rlvr_config import RLVRConfig


def load_processor(model_dir: str) -> Any:
    """The model directory's processor (``AutoProcessor``); ``ConfigError`` when it has none."""
    from transformers import AutoProcessor

    from areal_kernel.models import vision

    vision.check_supported(model_dir)
    try:
        return AutoProcessor.from_pretrained(model_dir)
    except Exception as e:
        raise ConfigError(f"model.path: no usable processor in {model_dir}: {type(e).__name__}: {e}") from None


class VisionPromptEncoder:
    """Record -> (prompt token ids, ImageInputs) with a processor and ``RLVRConfig`` settings."""

    def __init__(self, processor: Any, config: RLVRConfig) -> None:
        self.processor = processor
        self.config = config

    def text(self, record: dict[str, Any]) -> str:
        return fill_prompt_template(self.config.prompt_template, record, "workflow")

    def encode(self, record: dict[str, Any]) -> tuple[list[int], ImageInputs]:
        images = record_images(record)
        text = self.text(record)
        pieces = text.split(IMAGE_MARKER)
        n_markers = len(pieces) - 1
        if n_markers and n_markers != len(images):
            raise DataError(
                f"{record_label(record)}: the prompt has {n_markers} {IMAGE_MARKER} marker(s) but "
                f"{len(images)} image(s)"
            )
        if self.config.use_chat_template:
            content: list[dict[str, Any]] = []
            if n_markers:
                for k, piece in enumerate(pieces):
                    if piece:
                        content.append({"type": "text", "text": piece})
                    if k < n_markers:
                        content.append({"type": "image"})
            else:
                content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
            messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
            if self.config.system_prompt:
                messages.insert(0, {"role": "system", "content": self.config.system_prompt})
            rendered = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            rendered = text if n_markers else IMAGE_MARKER * len(images) + text
        from areal_kernel.models.vision import decode_image

        label = record_label(record)
        pil = [decode_image(f, f"{label}: image {i}") for i, f in enumerate(images.files)]
        try:
            enc = self.processor(text=rendered, images=[pil])
        except ValueError as e:  # the processor's own count check
            raise DataError(f"{label}: the processor rejected the prompt and its images: {e}") from None
        ids = enc["input_ids"][0]
        return [int(x) for x in ids], images


class VisionRLVRWorkflow(RLVRWorkflow):
    required_fields: tuple[str, ...] = ("prompt", "answer", "images")

    def __init__(self, *, tokenizer: Any, config: RLVRConfig | None = None, processor: Any = None, **kwargs: Any):
        super().__init__(tokenizer=tokenizer, config=config, **kwargs)
        if processor is None:
            # The tokenizer was loaded from the model directory; its processor lives beside it.
            processor = load_processor(str(getattr(tokenizer, "name_or_path", "")))
        self.encoder = VisionPromptEncoder(processor, self.config)

    def encode_prompt(self, record: dict[str, Any]) -> list[int]:
        return self.encoder.encode(record)[0]

    def prompt(self, record: dict[str, Any]) -> tuple[list[int], ImageInputs | None]:
        return self.encoder.encode(record)
