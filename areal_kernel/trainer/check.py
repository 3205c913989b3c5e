"""``areal check``: a few samples through data, template, engine and reward,
printed, before anyone spends hours on a run that cannot learn."""

from __future__ import annotations

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


def prompt_ids(workflow: Any, record: dict[str, Any], group: Any) -> list[int]:
    """The prompt ``areal check`` shows for ``record``: the workflow's optional
    ``encode_prompt(record)`` when it has one (one that raises
    ``NotImplementedError``, the ``Workflow`` default, counts as none), else the tokens before the
    first generated token of the group's first trajectory (what the engine
    was asked to continue), so a workflow with only the required members works."""
    encode = getattr(workflow, "encode_prompt", None)
    if callable(encode):
        try:
            return list(encode(record))
        except NotImplementedError:
            pass  # the Workflow base class's default: no encoder of its own
    t = group.trajectories[0]
    first = next((i for i, m in enumerate(t.loss_mask) if m), len(t.input_ids))
    return list(t.input_ids[:first])


def completion_text(tokenizer: Any, trajectory: Any) -> str:
    """The completion ``areal check`` shows: the trajectory's optional
    ``metadata["completion"]`` (a workflow's own rendering, e.g. the last
    turn), else its generated tokens decoded with special tokens skipped."""
    text = trajectory.metadata.get("completion")
    if text is not None:
        return str(text)
    generated = [t for t, m in zip(trajectory.input_ids, trajectory.loss_mask) if m]
    return str(tokenizer.decode(generated, skip_special_tokens=True))


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
        groups = rollout.run_episodes(records, "areal check")
    finally:
        rollout.stop()
    total, ok = 0, 0
    for rec, group in zip(records, groups):
        print("=" * 72)
        print(f"record {rec.get('id')}  answer={rec.get('answer')!r}")
        if group is None:
            print("  (the workflow rejected this record: arun_episode returned None)")
            continue
        print("prompt (as the model sees it):")
        print("  " + tok.decode(prompt_ids(rollout.workflow, rec, group)).replace("\n", "\n  "))
        for t in group.trajectories:
            gen_versions = sorted({v for v, m in zip(t.versions, t.loss_mask) if m})
            total += 1
            ok += t.reward > 0
            print(
                f"  -> reward {t.reward:.2f}  tokens {t.n_generated:3d}  versions {gen_versions}  "
                f"completion {completion_text(tok, t)!r}"
            )
    print("=" * 72)
    print(f"{ok}/{total} samples scored above 0 (reward '{cfg.reward.type}', workflow '{cfg.workflow.type}')")
    return 0
