"""Tiny random models for fast tests (a few hundred KB, forward in milliseconds).

They are built in ``areal_kernel.models.tiny`` (the model layer also builds
the known model ``tiny-vlm-random`` from them); this is their name for tests.
"""

from areal_kernel.models.tiny import (
    VLM_CHAT_TEMPLATE,
    VLM_IMAGE_TOKENS,
    make_tiny_byte_chat_llama,
    make_tiny_chat_llama,
    make_tiny_llama,
    make_tiny_vlm,
)

__all__ = [
    "VLM_CHAT_TEMPLATE",
    "VLM_IMAGE_TOKENS",
    "make_tiny_byte_chat_llama",
    "make_tiny_chat_llama",
    "make_tiny_llama",
    "make_tiny_vlm",
]
