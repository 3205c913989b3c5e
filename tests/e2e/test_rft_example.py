"""The worked example of docs/plugin-authoring.md ("A trainer that uses
inference servers"): the rejection-sampling fine-tuning trainer of
``examples/rft_plugin``, pip-installed into a private directory and run by
the real ``areal`` CLI on a tiny random Llama with SmolLM2's tokenizer, an
embedded inference server, reward workers and disk weight updates.

The reward is a test plugin's (``text_hash``: ``probe_score`` of the
completion), which keeps about half of a random model's samples and which
the test recomputes itself from the texts the trainer logged.

Over 60 s: ``test_rft_trains_on_kept_samples_and_its_nll_falls`` is a
learning run and its ``lr=0`` control (about 20 s of CPU each: a server
start, six steps of sampling, scoring, training and a weight update), and
``TestRFTContract`` runs the trainer once more in-process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from e2e_paths import REPO

from areal_kernel.testing.contracts import TrainerContract
from areal_kernel.testing.packages import pip_install_private, use_private_site
from areal_kernel.testing.probe_reward import probe_score

EXAMPLE = os.path.join(REPO, "examples", "rft_arithmetic.yaml")
MIN_REWARD = 0.3


@pytest.fixture(scope="module")
def rft_sites(tmp_path_factory) -> list[Path]:
    return [
        pip_install_private(Path(REPO) / "examples" / "rft_plugin", tmp_path_factory.mktemp("rft")),
        pip_install_private(
            Path(__file__).parent / "plugin_packages" / "areal-test-rft-reward", tmp_path_factory.mktemp("reward")
        ),
    ]


@pytest.fixture
def rft_env(rft_sites) -> dict[str, str]:
    path = os.pathsep.join([*map(str, rft_sites), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path.rstrip(os.pathsep)}


def _overrides(model: str, run_dir: Path, steps: int) -> list[str]:
    return [
        f"model.path={model}", f"run_dir={run_dir}", f"trainer.max_steps={steps}", "trainer.batch_size=2",
        "trainer.eval_size=4", "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=8",
        "rollout.gconfig.temperature=1.0", "reward.type=text_hash", f"algorithm.rft.min_reward={MIN_REWARD}",
        "weight_update.mode=disk", "logging.sinks=[jsonl]",
    ]  # fmt: skip


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run(run_areal, rft_env, model: str, run_dir: Path, lr: float) -> tuple[dict, list[dict], list[dict]]:
    proc = run_areal(
        "train", EXAMPLE, *_overrides(model, run_dir, 6), f"actor.torch.lr={lr}", env=rft_env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    steps = [r for r in _rows(run_dir / "metrics.jsonl") if "rft/sampled" in r]
    return result, steps, _rows(run_dir / "rft_samples.jsonl")


def _nll_drop(steps: list[dict]) -> float:
    """Mean train/nll (on the kept samples, before each step's update) of
    steps 1-2 minus that of steps 5-6: how much likelier the policy has made
    what it samples and keeps."""
    nll = {r["step"]: r["train/nll"] for r in steps}
    return (nll[1] + nll[2]) / 2 - (nll[5] + nll[6]) / 2


# A random policy over SmolLM2's 49,152 tokens samples at ~log(49152) = 10.8
# nats per token; measured: the run at lr=0.1 drops by more than 8 nats by
# steps 5-6, its lr=0 twin by less than 0.1.
NLL_DROP_BAR = 2.0


def test_rft_trains_on_kept_samples_and_its_nll_falls(run_areal, rft_env, tiny_chat_model, tmp_path):
    result, steps, samples = _run(run_areal, rft_env, tiny_chat_model, tmp_path / "learn", lr=0.1)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    # Every sample's reward is the reward plugin's score of its text, and a
    # sample was kept exactly when that score reached min_reward.
    assert len(samples) == 6 * 2 * 4
    for s in samples:
        assert s["reward"] == pytest.approx(probe_score(s["completion"])), s
        assert s["kept"] == (probe_score(s["completion"]) >= MIN_REWARD), s
    kept = [s for s in samples if s["kept"]]
    assert 0 < len(kept) < len(samples), "the threshold must split the samples for this test to mean anything"
    # What was logged and trained is the kept samples, step by step.
    for r in steps:
        here = [s for s in samples if s["step"] == r["step"]]
        assert r["rft/sampled"] == len(here)
        assert r["rft/kept"] == sum(s["kept"] for s in here), (r, here)
    assert result["trained_samples"] == len(kept) and result["min_reward"] == MIN_REWARD
    assert os.path.isfile(os.path.join(result["checkpoint"], "config.json"))
    assert len(result["held_out_reward"]) == 2
    drop = _nll_drop(steps)
    assert drop > NLL_DROP_BAR, [r["train/nll"] for r in steps]

    # The frozen twin samples, scores and keeps the same way, but must fail the bar.
    _, frozen_steps, _ = _run(run_areal, rft_env, tiny_chat_model, tmp_path / "frozen", lr=0.0)
    frozen = _nll_drop(frozen_steps)
    assert frozen < NLL_DROP_BAR, (frozen, [r["train/nll"] for r in frozen_steps])


@pytest.mark.parametrize(
    "override, field",
    [("algorithm.rft.min_reward=high", "algorithm.rft.min_reward"), ("algorithm.rft.min_rewrd=1", "min_rewrd")],
)
def test_a_bad_rft_setting_is_one_error_naming_the_field(run_areal, rft_env, tmp_path, override, field):
    proc = run_areal("train", EXAMPLE, f"run_dir={tmp_path / 'run'}", override, env=rft_env, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("areal: error:")]
    assert len(errors) == 1 and field in proc.stderr.split("areal: error:", 1)[1], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # refused before anything was written


class TestRFTContract(TrainerContract):
    @pytest.fixture
    def trainer_name(self, rft_sites, monkeypatch, areal_env) -> str:
        for site in rft_sites:
            use_private_site(site, monkeypatch, areal_env)
        return "rft"

    @pytest.fixture
    def trainer_config(self, tiny_chat_model, tmp_path) -> dict[str, Any]:
        from areal_kernel.config import read_yaml

        cfg = read_yaml(EXAMPLE)
        # The suite sets run_dir and algorithm.type; the rest as a user overrides it.
        return _nested(cfg, [o for o in _overrides(tiny_chat_model, tmp_path, 2) if not o.startswith("run_dir=")])


def _nested(cfg: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    import yaml

    for item in overrides:
        key, _, raw = item.partition("=")
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw)
    return cfg
