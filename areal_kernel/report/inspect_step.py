"""``areal inspect RUN_DIR --step N``: one step's trained samples with their
provenance, as far as the run's ``samples.jsonl`` records it.

Runs record, per step, the weight version the step produced, the ids of the
prompt groups it trained on and, per trained sample, its provenance (the
``samples`` list: id, reward, the weight versions of its tokens, the server
that generated it; ``trainer.recovery.provenance``), printed field by field
(fields a later version adds show without a change here). A run from before
the per-sample records gets the ids and a line saying what it lacks.
"""

from __future__ import annotations

from typing import Any

from areal_kernel.report.rundir import SAMPLES_FILE, RunData, step_samples

# Per-sample fields in the order they are printed; others follow, sorted.
SAMPLE_FIELDS: tuple[str, ...] = ("uid", "server", "versions", "adapter", "reward", "prompt", "completion")
STEP_METRICS: tuple[tuple[str, str], ...] = (
    ("rollout/reward_mean", "sampling reward"),
    ("reward/mean", "trained reward"),
    ("rollout/staleness_mean", "staleness mean"),
    ("rollout/staleness_max", "max"),
    ("batch/sequences", "sequences"),
)


def _fmt(v: Any) -> str:
    # Counts are logged as floats (32.0): shown as integers.
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else str(round(v, 4))
    return str(v)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in str(text).splitlines() or [""])


def format_step(run: RunData, step: int) -> str:
    """What ``areal inspect`` prints for ``step`` (an ``ArealError`` naming
    the valid steps when the run has no record of it)."""
    record = step_samples(run, step)
    lines = [f"run {run.path}, step {step}: weight version after the step {record.get('version', '?')}"]
    metrics = [f"{label} {_fmt(v)}" for key, label in STEP_METRICS if (v := run.value(step, key)) is not None]
    lines.append(("metrics: " + ", ".join(metrics)) if metrics else "metrics: none logged for this step")
    per_sample = record.get("samples")
    if isinstance(per_sample, list) and per_sample:
        lines.append(f"{len(per_sample)} trained sample(s):")
        for i, sample in enumerate(per_sample, 1):
            if not isinstance(sample, dict):
                lines.append(f"  [{i}] {sample!r}")
                continue
            lines.append(f"  [{i}]")
            keys = [k for k in SAMPLE_FIELDS if k in sample] + sorted(k for k in sample if k not in SAMPLE_FIELDS)
            for k in keys:
                value = sample[k]
                if isinstance(value, str) and "\n" in value:
                    lines.append(f"    {k}:")
                    lines.append(_indent(value, "      | "))
                else:
                    lines.append(f"    {k}: {value}")
        return "\n".join(lines)
    uids = [str(u) for u in record.get("uids", [])]
    lines.append(f"{len(uids)} trained sample id(s) (one per prompt group):")
    lines.extend(f"  {u}" for u in uids)
    lines.append(
        f"not in this run's {SAMPLES_FILE}: each sample's prompt, completion, reward, the weight versions of its "
        "tokens and its server (it records the ids of the samples each step trained on and the version the step made)"
    )
    return "\n".join(lines)
