import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "grpo_arithmetic.yaml")


@pytest.fixture(scope="session")
def smollm2_dir():
    from areal_kernel.models.resolve import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_chat_model(smollm2_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer and chat template."""
    from areal_kernel.testing.models import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-chat")), tokenizer_from=smollm2_dir)
