"""Dataset sources as registered factories: ``(config, seed, required) -> (train, eval)``.

``config`` is the validated ``dataset`` section; each source's own settings
(``dataset.arithmetic: {...}``) are in ``config.plugin_config``.
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.errors import DataError


class ArithmeticSourceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n_train: int = Field(4096, ge=1, description="Training questions (problems repeat past the problem space).")
    n_eval: int = Field(32, ge=0, description="Held-out questions, disjoint from training.")
    split_seed: int | None = Field(
        None,
        description="Seed that picks the held-out questions (default: the run's seed). Fix it to compare "
        "runs of different seeds on one held-out set.",
    )
    ops: list[str] = Field(default_factory=lambda: ["+"], description="Any of + - *.")
    min_operand: int = 0
    max_operand: int = 9


def arithmetic_source(config: Any, seed: int, required: Sequence[str] = ()) -> tuple[list[dict], list[dict]]:
    from areal_kernel.data.arithmetic import arithmetic_splits

    c: ArithmeticSourceConfig = config.plugin_config or ArithmeticSourceConfig()
    return arithmetic_splits(
        c.n_train,
        c.n_eval,
        seed,
        split_seed=c.split_seed,
        ops=tuple(c.ops),
        min_operand=c.min_operand,
        max_operand=c.max_operand,
    )


def file_source(config: Any, seed: int, required: Sequence[str] = ("prompt",)) -> tuple[list[dict], list[dict]]:
    """Local jsonl/json/parquet/csv file or directory, or (``hub``) a dataset name."""
    from areal_kernel.data.loaders import load_records
    from areal_kernel.data.split import train_eval_split

    if not config.path:
        raise DataError(f"dataset.path is required for dataset.type '{config.type}'")
    field_map = config.field_map or None
    fields = list(required)
    train = load_records(config.path, split=config.split, limit=config.limit, field_map=field_map, required=fields)
    if config.eval_split:
        evals = load_records(config.path, split=config.eval_split, field_map=field_map, required=fields)
    elif config.eval_fraction > 0:
        train, evals = train_eval_split(train, config.eval_fraction, seed)
    else:
        evals = []
    if any("images" in r for r in train[:1] + evals[:1]):
        # Image paths in a dataset file are relative to that file's directory.
        import os

        from areal_kernel.data.images import resolve_image_paths

        src = os.path.expanduser(config.path)
        base = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
        resolve_image_paths(train, base)
        resolve_image_paths(evals, base)
    return train, evals
