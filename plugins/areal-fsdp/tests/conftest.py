"""Fixtures of the areal-fsdp tests: a tiny random Llama on disk and one
2-rank engine shared by the tests that only need *an* initialized engine
(starting ranks costs a few seconds of imports per process)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Tiny random Llama (vocab 256, 2 layers, tied embeddings); weights drawn
    with std 0.2 so greedy generations depend on the weights."""
    import torch
    from safetensors.torch import load_file, save_file

    from areal_kernel.testing.models import make_tiny_llama

    d = make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), seed=3)
    path = os.path.join(d, "model.safetensors")
    sd = load_file(path)
    g = torch.Generator().manual_seed(0)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.2 if v.dim() > 1 else v) for k, v in sd.items()}
    save_file(sd, path, metadata={"format": "pt"})
    return d


@pytest.fixture(scope="session")
def shared_engine(tiny_model_dir):
    """A 2-rank fsdp engine (gloo), lr 1e-3, small micro-batches."""
    from areal_fsdp.engine import FSDPTrainEngine

    e = FSDPTrainEngine({"lr": 1e-3, "max_tokens_per_mb": 8}, world_size=2)
    e.initialize(tiny_model_dir, 20)
    yield e
    e.destroy()
