"""Helpers of the vision-language tests: synthetic images and image prompts."""

from __future__ import annotations


def png(colour: tuple[int, int, int], size: int = 32, square: int = 0) -> bytes:
    """A solid image, optionally with a white square of side ``square`` in the middle."""
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), colour)
    if square:
        lo = (size - square) // 2
        ImageDraw.Draw(img).rectangle([lo, lo, lo + square - 1, lo + square - 1], fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def image_prompt(processor, images, text: str = "What colour is it?") -> list[int]:
    """Token ids of a one-turn chat prompt with ``images`` (ImageInputs) before ``text``."""
    import io

    from PIL import Image

    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    rendered = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(f)).convert("RGB") for f in images.files]
    return list(processor(text=rendered, images=[pil], return_tensors="pt")["input_ids"][0].tolist())
