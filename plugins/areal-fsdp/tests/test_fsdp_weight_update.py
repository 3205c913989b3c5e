"""In-memory weight update from 2 FSDP ranks to a real embedded inference
server, through the kernel's weight-transport hook and registry (the same
path ``areal train`` takes), and the disk transport with the streamed export:
the kernel's suites in ``areal_kernel.testing.rank_engines`` on the session's
shared 2-rank engine (conftest.shared_engine)."""

from __future__ import annotations

import pytest

from areal_kernel.testing.rank_engines import RankEngineDiskUpdateSuite, RankEngineWeightUpdateSuite


class TestFSDPWeightUpdate(RankEngineDiskUpdateSuite, RankEngineWeightUpdateSuite):
    ENGINE_NAME = "fsdp"

    @pytest.fixture
    def update_engine(self, shared_engine):
        return shared_engine
