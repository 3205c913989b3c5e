"""The docs' trainer example (docs/plugin-authoring.md, Trainers): no model,
only the contract: settings in, metric sinks and hooks during, result out."""
import json
import os

from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.api.trainer import Trainer, TrainerContext
from areal_kernel.errors import ConfigError
from areal_kernel.plugins import get_plugin_manager
from areal_kernel.trainer.common import make_sinks, write_run_config


class CountUpSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silently ignored key

    steps: int = Field(3, ge=1)
    start: float = 0.0
    increment: float = Field(1.0, gt=0)
    fail_at: int | None = Field(None, ge=1, description="raise a plain exception at this step (a plugin bug)")


class CountUpTrainer(Trainer):
    def __init__(self, context: TrainerContext) -> None:
        super().__init__(context)
        self.sinks = []
        self.value = self.settings.start

    def setup(self) -> None:
        if self.cfg.trainer.max_steps is not None and self.cfg.trainer.max_steps < self.settings.steps:
            raise ConfigError(
                f"algorithm.count_up.steps={self.settings.steps} exceeds trainer.max_steps={self.cfg.trainer.max_steps}"
            )
        write_run_config(self.cfg, self.run_dir)
        self.sinks = make_sinks(self.cfg, self.run_dir, self.settings.steps)

    def train(self) -> dict:
        hook = get_plugin_manager().hook
        for step in range(1, self.settings.steps + 1):
            if step == self.settings.fail_at:
                raise RuntimeError(f"count_up broke at step {step}")
            self.value += self.settings.increment
            metrics = {"train/value": self.value}
            for sink in self.sinks:
                sink.log(step, metrics)
            hook.areal_on_train_step(step=step, metrics=metrics)
        return {"trainer": self.context.name, "steps": self.settings.steps, "value": self.value,
                "settings_type": type(self.settings).__name__}

    def close(self, status: str) -> None:
        for sink in self.sinks:
            sink.close()
        # The test reads this: close() ran once, with the final status.
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "closed.json"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"status": status}) + "\n")
