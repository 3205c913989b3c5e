"""Suite-wide rules for running the tests on both cores (``make test`` runs
``pytest -n 2``, see the Makefile).

- A test file is one unit of work, so its module- and class-scoped fixtures
  (a vLLM server, a Ray or Slurm cluster, shared rank processes) start once,
  on one worker.
- The files in ``BIG_MEMORY_FILES`` are ONE unit together: each needs several
  GB (a vLLM server, SmolLM2 train ranks), and two of them side by side would
  not fit in the machine's memory. That unit is handed out first, since it
  is the longest; the other worker takes the remaining files meanwhile.

Without ``-n`` only the order changes (these files run first).

The units are made by a scheduler of our own (xdist's public
``pytest_xdist_make_scheduler`` hook), not by ``xdist_group`` markers: with
the pytest this project installs (9.2), xdist's ``loadgroup`` mode no longer
groups anything (it renames a node attribute that pytest stopped reading),
and every test became its own unit."""

from __future__ import annotations

from typing import Any

import pytest

BIG_MEMORY_UNIT = "big-memory"

# Each needs several GB; the comment says what.
BIG_MEMORY_FILES = frozenset({
    "plugins/areal-vllm/tests/test_grpo_vllm.py",  # a vLLM server beside SmolLM2's train engine
    "plugins/areal-vllm/tests/test_vllm_restart.py",  # a vLLM server, restarted, beside SmolLM2's
    "plugins/areal-vllm/tests/test_vllm_server.py",  # vLLM servers
    "plugins/areal-vllm/tests/test_vllm_vlm.py",  # a vLLM server
    "plugins/areal-megatron/tests/test_megatron_e2e_grpo.py",  # two SmolLM2 Megatron ranks
    "plugins/areal-megatron/tests/test_megatron_parity.py",  # SmolLM2 Megatron ranks (the session rank pool)
    "plugins/areal-megatron/tests/test_megatron_contract.py",  # the same rank pool
    "plugins/areal-megatron/tests/test_megatron_weight_update.py",  # the same rank pool
    "plugins/areal-megatron/tests/test_megatron_layouts.py",  # a SmolLM2 Megatron rank, then 4 ranks (~5 GB)
    "plugins/areal-fsdp/tests/test_fsdp_e2e_grpo.py",  # two SmolLM2 FSDP ranks
})  # fmt: skip


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the big-memory unit."""
    path = nodeid.split("::", 1)[0]
    return BIG_MEMORY_UNIT if path in BIG_MEMORY_FILES else path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    big = [i for i in items if unit_of(i.nodeid) == BIG_MEMORY_UNIT]
    if big:
        chosen = set(map(id, big))
        items[:] = big + [i for i in items if id(i) not in chosen]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with ``unit_of`` as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    # Units in collection order (the big-memory unit first), not by test count.
    config.option.loadscopereorder = False
    return UnitScheduling(config, log)
