"""``areal check``: a few samples through data, template, engine and reward,
printed, before anyone spends hours on a run that cannot learn."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from areal_kernel.config.models import ExperimentConfig
from areal_kernel.logging import setup_logging
from areal_kernel.trainer.components import (
    Rollout,
    load_data,
    load_tokenizer,
    resolve_model_dir,
    stored_dtype,
    workflow_required_fields,
)
from areal_kernel.utils import aio


async def _episodes(rollout: Rollout, records: list[dict]) -> list[Any]:
    try:
        return await asyncio.gather(*(rollout.workflow.arun_episode(rollout.engine, r) for r in records))
    finally:
        await rollout.engine.aclose(current_loop_only=True)


def run_check(cfg: ExperimentConfig, n: int = 4) -> int:
    from areal_kernel.plugins.blame import plugin_failures_reported

    setup_logging(level=cfg.logging.level, json_logs=cfg.logging.json_logs)
    # As in `areal train`: plugin crashes are one line, tracebacks in <run_dir>/check/error.log.
    with plugin_failures_reported(os.path.join(cfg.resolved_run_dir(), "check")):
        return _run_check(cfg, n)


def _run_check(cfg: ExperimentConfig, n: int) -> int:
    model_dir = resolve_model_dir(cfg)
    # Data before the tokenizer: a bad dataset file is the likelier mistake and
    # its check is cheap, so report it before importing transformers.
    train, evals = load_data(cfg, workflow_required_fields(cfg))
    tok = load_tokenizer(model_dir)
    print(f"model: {model_dir} (weights stored as {stored_dtype(model_dir) or 'unknown'}, run in {cfg.model.dtype})")
    print(f"dataset '{cfg.dataset.type}': {len(train)} train / {len(evals)} eval records")
    records = train[:n]
    rollout = Rollout(cfg, os.path.join(cfg.resolved_run_dir(), "check"), model_dir, tok)
    try:
        rollout.start()
        groups = aio.run(_episodes(rollout, records), "areal check")
    finally:
        rollout.stop()
    total, ok = 0, 0
    for rec, group in zip(records, groups):
        prompt_ids = rollout.workflow.encode_prompt(rec)
        print("=" * 72)
        print(f"record {rec.get('id')}  answer={rec.get('answer')!r}")
        print("prompt (as the model sees it):")
        print("  " + tok.decode(prompt_ids).replace("\n", "\n  "))
        for t in group.trajectories:
            gen_versions = sorted({v for v, m in zip(t.versions, t.loss_mask) if m})
            total += 1
            ok += t.reward > 0
            print(
                f"  -> reward {t.reward:.2f}  tokens {t.n_generated:3d}  versions {gen_versions}  "
                f"completion {t.metadata.get('completion', '')!r}"
            )
    print("=" * 72)
    print(f"{ok}/{total} samples scored above 0 (reward '{cfg.reward.type}', workflow '{cfg.workflow.type}')")
    return 0
