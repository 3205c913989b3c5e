"""Bad user input through the real ``areal`` CLI (subprocesses): each case
exits with code 2, prints a short message that names the field/file/plugin
and what is valid, shows no traceback, and matches ``docs/bad-inputs.md``."""
from __future__ import annotations

from pathlib import Path

import pytest

from bad_inputs import CASES, DOC, Result, render, run_all  # pytest puts this directory on sys.path


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    # All cases once, a few at a time: each is a fresh CLI process.
    return run_all(tmp_path_factory.mktemp("bad-inputs"))


def test_at_least_25_distinct_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_clear_error(results, case):
    r = results[case.id]
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    lines = r.message.splitlines()
    assert 1 <= len(lines) <= 3, r.stderr
    assert any(line.startswith("areal: error: ") for line in lines), r.stderr
    for fragment in case.expect:
        assert fragment in r.message, f"{fragment!r} not in {r.message!r}"


def test_doc_table_matches_what_the_cli_prints(results):
    expected = render(results)
    actual = DOC.read_text(encoding="utf-8")
    assert actual == expected, (
        "docs/bad-inputs.md is out of date with the CLI; regenerate it with "
        "`python tests/faults/bad_inputs.py --write` and review the diff"
    )


def test_failed_run_leaves_earlier_checkpoint_and_metrics_untouched(results):
    r = results["existing-run-bad-data"]
    run = r.ctx.tmp / "run"
    assert (run / "checkpoints" / "step2" / "model.safetensors").read_bytes() == b"earlier weights"
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step2"]


def test_port_case_leaves_no_server_behind(results):
    # The clash is found before anything is spawned: no server log was written.
    r = results["port-taken"]
    assert not list(Path(r.ctx.tmp).rglob("server-*.log"))


def test_debug_adds_the_traceback(run_areal, tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("trainer:\n  batch_size: 0\n")
    plain = run_areal("validate", str(bad))
    debug = run_areal("--debug", "validate", str(bad))
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "trainer.batch_size" in debug.stderr
