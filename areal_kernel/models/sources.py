"""Registered model sources: ``fn(variant) -> local HF directory``.

``model.path: smollm2-135m-instruct@float32`` calls the source registered as
``smollm2-135m-instruct`` with variant ``float32``.
"""

from __future__ import annotations


def smollm2_source(variant: str | None = None) -> str:
    from areal_kernel.models.resolve import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct" + (f"@{variant}" if variant else ""))
