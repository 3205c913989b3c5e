"""Records with images: ``images: [path or bytes, ...]`` beside the text fields.

A path is a local image file (relative paths are relative to the dataset
file's directory; ``resolve_image_paths`` makes them absolute when the
dataset is read); bytes are an encoded image file (PNG, JPEG, ...), as a
parquet dataset or a generator holds them.

``check_record_images`` runs on every record when the dataset is loaded, so a
missing file, an image over the limits or an image count that does not fit
the prompt is one ``DataError`` naming the record, before any server starts.
Only image headers are read there; ``record_images`` reads the files when an
episode starts (once per prompt, whatever the number of samples).

The prompt's ``<image>`` markers say where each image goes; a prompt without
markers gets all its images before the text. With markers, their number must
equal the number of images.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

from areal_kernel.api.io import ImageInputs
from areal_kernel.errors import DataError

IMAGE_MARKER = "<image>"


@dataclass(frozen=True)
class ImageLimits:
    """What one record's images may be."""

    max_images: int = 8
    max_image_bytes: int = 8 << 20
    max_image_pixels: int = 4096 * 4096


def record_label(record: dict[str, Any], index: int | None = None) -> str:
    rid = record.get("id")
    if rid not in (None, ""):
        return f"record {rid!r}"
    return f"record {index}" if index is not None else "record (no id)"


def resolve_image_paths(records: Sequence[dict[str, Any]], base_dir: str) -> None:
    """Make relative image paths of ``records`` absolute against ``base_dir`` (in place)."""
    for rec in records:
        imgs = rec.get("images")
        if isinstance(imgs, list):
            rec["images"] = [
                os.path.normpath(os.path.join(base_dir, x)) if isinstance(x, str) and not os.path.isabs(x) else x
                for x in imgs
            ]


def _image_size(item: Any, where: str) -> tuple[int, int]:
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        src = io.BytesIO(item) if isinstance(item, (bytes, bytearray)) else item
        with Image.open(src) as img:  # reads the header only
            return img.size
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where} is not a readable image ({type(e).__name__}: {e})") from None


def check_record_images(
    record: dict[str, Any],
    *,
    origin: str,
    index: int | None = None,
    limits: ImageLimits = ImageLimits(),
    text_field: str = "prompt",
) -> int:
    """Check ``record['images']`` (see the module docstring); returns the image count."""
    label = f"{origin}: {record_label(record, index)}"
    imgs = record.get("images")
    if not isinstance(imgs, list) or not imgs:
        raise DataError(f"{label}: field 'images' must be a non-empty list of image paths or bytes, got {imgs!r:.80}")
    if len(imgs) > limits.max_images:
        raise DataError(f"{label} has {len(imgs)} images; at most {limits.max_images} per record")
    text = record.get(text_field)
    if isinstance(text, str) and IMAGE_MARKER in text:
        n_markers = text.count(IMAGE_MARKER)
        if n_markers != len(imgs):
            raise DataError(
                f"{label}: its {text_field!r} has {n_markers} {IMAGE_MARKER} marker(s) but the record has "
                f"{len(imgs)} image(s); give one marker per image, or none to put every image before the text"
            )
    for i, item in enumerate(imgs):
        where = f"{label}: image {i}"
        if isinstance(item, (bytes, bytearray)):
            size = len(item)
        elif isinstance(item, str) and item:
            if not os.path.isfile(item):
                raise DataError(f"{where}: image file {item!r} does not exist")
            size = os.path.getsize(item)
            where = f"{where} ({item})"
        else:
            raise DataError(f"{where} must be a file path or the bytes of an image file, got {type(item).__name__}")
        if size == 0:
            raise DataError(f"{where} is empty (0 bytes)")
        if size > limits.max_image_bytes:
            raise DataError(f"{where} is too large: {size} bytes (limit {limits.max_image_bytes})")
        w, h = _image_size(item, where)
        if w * h > limits.max_image_pixels:
            raise DataError(f"{where} is too large: {w}x{h} pixels (limit {limits.max_image_pixels} pixels)")
    return len(imgs)


def check_records_images(
    records: Sequence[dict[str, Any]], *, origin: str, limits: ImageLimits = ImageLimits()
) -> None:
    """``check_record_images`` on every record that has an ``images`` field."""
    for i, rec in enumerate(records):
        if "images" in rec:
            check_record_images(rec, origin=origin, index=i, limits=limits)


def record_images(record: dict[str, Any]) -> ImageInputs:
    """The record's images as one ``ImageInputs`` (files read here, once per episode)."""
    out: list[bytes] = []
    for i, item in enumerate(record.get("images") or []):
        if isinstance(item, (bytes, bytearray)):
            out.append(bytes(item))
            continue
        try:
            with open(item, "rb") as fh:
                out.append(fh.read())
        except OSError as e:
            raise DataError(f"{record_label(record)}: image {i} ({item}) cannot be read: {e}") from None
    if not out:
        raise DataError(f"{record_label(record)} has no images")
    return ImageInputs(tuple(out))
