"""examples/custom_loop.py: a user's own loop from the public API (embedded
server process, remote client, rollout executor, torch engine, RL step, disk
weight updates), run as a script in a fresh process, as a user would."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_loop.py"


def test_custom_loop_example_trains_and_updates_the_server(tmp_path):
    steps, staleness = 3, 1
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(tmp_path), "--steps", str(steps),
         "--max-staleness", str(staleness)],
        capture_output=True, text=True, env=env, timeout=600, cwd=str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == steps and [h["step"] for h in summary["history"]] == list(range(1, steps + 1))
    assert summary["version"] == steps
    assert summary["weights_changed"] is True
    # The server reloaded every update: a generation after the loop carries the last version.
    assert summary["server_token_versions"] == [steps]
    for h in summary["history"]:
        # Step k trains at version k-1: its tokens are at most `staleness` versions older.
        assert h["token_versions"], h
        assert min(h["token_versions"]) >= h["step"] - 1 - staleness, h
        assert max(h["token_versions"]) <= h["step"] - 1, h
    assert f"done: {steps} steps" in proc.stdout
