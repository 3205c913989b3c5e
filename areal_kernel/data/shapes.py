"""A built-in, offline visual task: synthetic images of coloured shapes.

``task: colour``: one shape (square or disc, random size and place) on a dark
background; the answer is its colour's name. ``task: count``: 1..max_count
white squares; the answer is their number. Images are small PNGs made with
PIL, so a tiny random vision-language model can learn the task on a CPU in
minutes: first supervised (the answer format), then with RL (the reward).

``dataset.type: shapes`` serves them from memory (``images`` hold PNG bytes);
``write_shapes_dataset`` writes the same records as PNG files plus a jsonl of
relative paths (what a ``file`` dataset reads).
"""

from __future__ import annotations

import io
import json
import os
import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.errors import ConfigError

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 230),
    "yellow": (230, 210, 40),
}
PROMPTS = {
    "colour": "What colour is the shape? Answer with one word: {choices}.",
    "count": "How many squares are there? Answer with one number.",
}


class ShapesSourceConfig(BaseModel):
    """Settings of ``dataset.type: shapes`` (``dataset.shapes``)."""

    model_config = ConfigDict(extra="forbid")

    task: Literal["colour", "count"] = "colour"
    n_train: int = Field(512, ge=1, description="Training records.")
    n_eval: int = Field(32, ge=0, description="Held-out records (other images).")
    image_size: int = Field(32, ge=8, le=1024, description="Side of the square images, in pixels.")
    colours: list[str] = Field(default_factory=lambda: ["red", "green", "blue"], description=f"Of {list(COLOURS)}.")
    max_count: int = Field(3, ge=1, le=9, description="count task: 1..max_count squares.")


def _png(img: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def shape_image(rng: random.Random, task: str, size: int, colour: str, count: int) -> bytes:
    """One PNG of the task: a ``colour`` shape, or ``count`` white squares."""
    from PIL import Image, ImageDraw

    shade = rng.randrange(0, 40)
    img = Image.new("RGB", (size, size), (shade, shade, shade))
    draw = ImageDraw.Draw(img)
    if task == "colour":
        # Large shapes: every image patch of a tiny model sees colour, so the task is learnable in minutes.
        side = rng.randrange(max(3, size // 3), max(4, size * 3 // 4))
        x, y = rng.randrange(0, size - side + 1), rng.randrange(0, size - side + 1)
        box = [x, y, x + side - 1, y + side - 1]
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=COLOURS[colour])
        return _png(img)
    # Squares on a grid of cells, at most one per cell: they never touch.
    cells = 3 if count <= 9 else 4
    cell = size // cells
    side = max(2, cell * 2 // 3)
    for k in rng.sample(range(cells * cells), count):
        cx, cy = (k % cells) * cell, (k // cells) * cell
        ox, oy = rng.randrange(0, cell - side + 1), rng.randrange(0, cell - side + 1)
        draw.rectangle([cx + ox, cy + oy, cx + ox + side - 1, cy + oy + side - 1], fill=(245, 245, 245))
    return _png(img)


def shapes_records(
    n: int,
    seed: int,
    *,
    task: str = "colour",
    image_size: int = 32,
    colours: list[str] | None = None,
    max_count: int = 3,
    prefix: str = "shapes",
) -> list[dict[str, Any]]:
    """``n`` records ``{"id", "images": [png bytes], "prompt", "answer"}``; the same arguments give the same list."""
    colours = list(colours or ["red", "green", "blue"])
    bad = [c for c in colours if c not in COLOURS]
    if bad or not colours:
        raise ConfigError(f"dataset.shapes.colours {colours!r} invalid; valid colours: {list(COLOURS)}")
    if task not in PROMPTS:
        raise ConfigError(f"dataset.shapes.task {task!r} invalid; valid: {list(PROMPTS)}")
    rng = random.Random(f"{seed}:{prefix}:{task}")
    prompt = PROMPTS[task].format(
        choices=", ".join(colours[:-1]) + f" or {colours[-1]}" if len(colours) > 1 else colours[0]
    )
    out = []
    for i in range(n):
        colour = colours[i % len(colours)] if task == "colour" else "white"
        count = rng.randint(1, max_count)
        answer = colour if task == "colour" else str(count)
        out.append(
            {
                "id": f"{prefix}:{i}",
                "images": [shape_image(rng, task, image_size, colour, count)],
                "prompt": prompt,
                "answer": answer,
            }
        )
    rng.shuffle(out)
    return out


def shapes_source(config: Any, seed: int, required: Any = ()) -> tuple[list[dict], list[dict]]:
    c: ShapesSourceConfig = config.plugin_config or ShapesSourceConfig()
    kw = dict(task=c.task, image_size=c.image_size, colours=c.colours, max_count=c.max_count)
    train = shapes_records(c.n_train, seed, prefix="shapes:train", **kw)  # type: ignore[arg-type]
    evals = shapes_records(c.n_eval, seed, prefix="shapes:eval", **kw) if c.n_eval else []  # type: ignore[arg-type]
    return train, evals


def write_shapes_dataset(out_dir: str, n: int, seed: int = 0, **kwargs: Any) -> str:
    """Write ``n`` records as ``out_dir/images/<i>.png`` and ``out_dir/data.jsonl``
    (image paths relative to ``out_dir``); returns the jsonl path."""
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    path = os.path.join(out_dir, "data.jsonl")
    with open(path, "w", encoding="utf-8") as fh:
        for i, rec in enumerate(shapes_records(n, seed, **kwargs)):
            rel = f"images/{i}.png"
            with open(os.path.join(out_dir, rel), "wb") as img:
                img.write(rec["images"][0])
            fh.write(json.dumps({**rec, "images": [rel]}) + "\n")
    return path
