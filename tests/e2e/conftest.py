import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    from areal_kernel.models.resolve import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_chat_model(smollm2_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer and chat template."""
    from areal_kernel.testing.models import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-chat")), tokenizer_from=smollm2_dir)
