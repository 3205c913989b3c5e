"""Fixtures of the engine tests (helpers live in engine_helpers.py)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from engine_helpers import make_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    import torch

    torch.set_num_threads(1)
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama_tied")), tie=True, seed=1)
