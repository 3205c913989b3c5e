"""Suite-wide collection rules (every test under tests/ and plugins/).

CI runs the suite on both cores of its machine (``pytest -n 2 --dist
loadgroup``, see the Makefile). Two rules keep that safe and short:

- a test file is one unit of work, so its module- and class-scoped fixtures
  (a vLLM server, a Ray or Slurm cluster) start once, on one worker;
- the files marked ``big_memory`` are one unit together: two of them side by
  side (say SmolLM2's FSDP ranks and a vLLM server) would not fit in memory.
  That unit is handed out first, since it is the longest one; the other
  worker takes the remaining files meanwhile.

Without xdist (``pytest`` on its own) only the order changes."""

from __future__ import annotations

import pytest

BIG_MEMORY_GROUP = "big-memory"


# First: xdist's own hook (on each worker) turns the group marker into the
# test's scope, and the plain file path must be read before that.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    big = [i for i in items if i.get_closest_marker("big_memory") is not None]
    if big:
        chosen = set(map(id, big))
        items[:] = big + [i for i in items if id(i) not in chosen]
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = BIG_MEMORY_GROUP if item.get_closest_marker("big_memory") is not None else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
