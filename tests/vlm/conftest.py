"""Fixtures for the vision-language tests: a tiny random Idefics3 (SmolVLM-style)
model with its real processor on disk, and prompts with synthetic images."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory) -> str:
    from areal_kernel.testing.models import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="session")
def vlm_processor(vlm_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm_dir)
