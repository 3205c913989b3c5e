"""Fixtures of the algorithm tests: a tiny random Llama (no tokenizer needed
here) and the test algorithm plugin."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal_kernel.testing.packages import private_plugin_fixtures

HERE = Path(__file__).resolve().parent

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama (vocab 256, untied embeddings), no tokenizer."""
    from areal_kernel.testing.models import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny_llama_algo"), seed=0, tie_word_embeddings=False, max_position_embeddings=256
    )


# A real third-party plugin (plugin_packages/areal-test-algo) installed into a
# private site directory once per module, enabled per test.

algo_plugin_site, with_algo_plugin = private_plugin_fixtures(HERE / "plugin_packages" / "areal-test-algo", "algo_plugin_site")
