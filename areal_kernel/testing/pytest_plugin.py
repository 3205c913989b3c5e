"""pytest plugin (``pytest11`` entry point ``areal_testing``): shared fixtures.

Loaded automatically when areal-kernel is installed. Fixtures here must stay
cheap to define: heavy work happens only when a test requests them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, Iterator

import pytest

from areal_kernel.utils import prefork


@pytest.fixture
def areal_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Set AREAL_* variables for one test and reset the kernel's caches
    (plugin manager, platform) before and after."""
    from areal_kernel.platforms import reset_current_platform
    from areal_kernel.plugins import reset_plugin_manager

    def set_env(**values: str | None) -> None:
        for key, value in values.items():
            if value is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, value)
        reset_plugin_manager()
        reset_current_platform()

    yield set_env
    reset_plugin_manager()
    reset_current_platform()


@pytest.fixture
def run_areal() -> Callable[..., subprocess.CompletedProcess]:
    """Run the ``areal`` CLI in a new process: ``run_areal("plugins", "--json", env={...})``
    (through the prefork server when ``PREFORK_ENV`` names one, see
    ``areal_kernel.utils.prefork``)."""

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: str | None = None):
        full_env = dict(os.environ)
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env.update(env or {})
        return prefork.run(
            [sys.executable, "-m", "areal_kernel.cli", *args],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
            cwd=cwd,
        )

    return run


@pytest.fixture(scope="session")
def areal_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama (vocab 256, no tokenizer) written once per test
    session: what the contract suites train, serve and update by default."""
    from areal_kernel.testing.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("areal-tiny-model"), seed=0)


@pytest.fixture(scope="session")
def areal_tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template
    (``make_tiny_chat_llama``), written once per test session: what the
    workflow contract renders prompts with and generates from by default."""
    from areal_kernel.testing.models import make_tiny_chat_llama

    return make_tiny_chat_llama(tmp_path_factory.mktemp("areal-tiny-chat-model"), seed=0)
