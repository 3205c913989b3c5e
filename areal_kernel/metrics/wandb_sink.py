"""The ``wandb`` metric sink (``logging.sinks: [..., wandb]``), configured by
``logging.wandb: {project, entity, mode, ...}``.

This module imports only pydantic at import time: config validation imports
``WandbSettings`` on machines without wandb, and ``import areal_kernel``
never imports wandb. ``WandbSink`` imports it when the trainer builds it.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.api.metric_sink import MetricSink
from areal_kernel.errors import ConfigError
from areal_kernel.metrics.sinks import _clean

WandbMode = Literal["online", "offline", "disabled"]


class WandbSettings(BaseModel):
    """``logging.wandb``; unset values fall back to wandb's own environment
    variables (``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_MODE``, ``WANDB_DIR``)
    and then to the defaults named here."""

    model_config = ConfigDict(extra="forbid")

    project: str | None = Field(None, description="W&B project; unset: WANDB_PROJECT, else 'areal'.")
    entity: str | None = Field(None, description="W&B team or user; unset: WANDB_ENTITY, else your default entity.")
    mode: WandbMode | None = Field(
        None,
        description="online: stream to the server; offline: write a local run directory only (upload later "
        "with `wandb sync`); disabled: log nothing. Unset: WANDB_MODE, else online.",
    )
    name: str | None = Field(None, description="Run name; unset: the run directory's name.")
    group: str | None = Field(None, description="Group runs together in the W&B UI.")
    tags: list[str] = Field(default_factory=list)
    notes: str | None = None
    dir: str | None = Field(
        None, description="Where wandb writes its local files (<dir>/wandb/...); unset: WANDB_DIR, else run_dir."
    )


class WandbSink(MetricSink):
    """Logs each step's numeric metrics to one wandb run; the resolved run
    config (``<run_dir>/config.yaml``) becomes the wandb run's config."""

    def __init__(
        self,
        run_dir: str,
        *,
        total_steps: int | None = None,
        project: str | None,
        entity: str | None,
        mode: WandbMode | None,
        name: str | None,
        group: str | None,
        tags: list[str],
        notes: str | None,
        dir: str | None,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "logging.sinks: the 'wandb' metric sink needs the wandb package; pip install wandb"
            ) from None
        import yaml

        config = None
        path = os.path.join(run_dir, "config.yaml")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                config = yaml.safe_load(f)
        local_dir = dir or os.environ.get("WANDB_DIR") or run_dir
        os.makedirs(local_dir, exist_ok=True)
        self.run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or "areal",
            entity=entity,
            mode=mode,
            name=name or os.path.basename(os.path.abspath(run_dir)),
            group=group,
            tags=tags or None,
            notes=notes,
            dir=local_dir,
            config=config,
            # Several runs of one process (tests, notebooks) must not share a wandb run.
            reinit="create_new",
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        # wandb keeps only the first row of a step it has already passed, so a
        # step re-logged after a resume is dropped (with wandb's warning).
        self.run.log(_clean(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
