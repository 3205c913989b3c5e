"""A torch train engine on the tiny model that has taken optimizer steps, so
its weights differ from the model directory's: what the LoRA-serving and the
weight-delivery tests send to real embedded servers."""

from __future__ import annotations

import random
from typing import Any

VOCAB = 384  # the tiny model's vocabulary (tests/inference/conftest.py)


def toy_loss(logprobs: Any, entropy: Any, data: dict[str, Any]) -> tuple[Any, dict]:
    """Raise the logprobs of reward-1 rows and lower those of reward-0 rows."""
    return -(logprobs * data["loss_mask"] * (data["rewards"] * 2 - 1)).sum() / data["batch_loss_tokens"], {}


def toy_batch(seed: int) -> Any:
    """Four random 12-token rows (4 prompt, 8 loss tokens), rewards 0 and 1."""
    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    rng = random.Random(seed)
    trajs = []
    for k in range(4):
        ids = [rng.randrange(VOCAB) for _ in range(12)]
        trajs.append(Trajectory(ids, [0] * 4 + [1] * 8, [0.0] * 12, [-1] * 4 + [0] * 8, float(k % 2)))
    return TrajectoryBatch(trajs)


def trained_engine(model_dir: str, lora: dict | None = None, steps: int = 1, seed: int = 0) -> Any:
    """A ``TorchTrainEngine`` (a LoRA adapter when ``lora``) after ``steps``
    steps at a large lr on ``toy_batch``es of ``seed``."""
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    e = TorchTrainEngine({"lr": 5e-2, "lora": lora, "seed": seed})
    e.initialize(model_dir, 10)
    for s in range(steps):
        e.train_batch(toy_batch(seed * 100 + s), toy_loss)
    return e


def random_adapter(
    model: Any, seed: int, targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"), scale: float = 0.1
) -> list[tuple[str, Any]]:
    """A rank-4 LoRA adapter for ``model``'s ``targets`` layers under peft's
    file names, with random A and B (``scale`` x a normal draw): loaded
    straight into a server's ``AdapterSet``, its update is not zero."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets:
            out.append((f"base_model.model.{name}.lora_A.weight", torch.randn(4, mod.in_features, generator=g) * scale))
            out.append((f"base_model.model.{name}.lora_B.weight", torch.randn(mod.out_features, 4, generator=g) * scale))
    return out
