"""Fault injectors, driven by the environment (rewards run in worker
processes that inherit it) or by ``algorithm.fault_nan_ppo`` (the loss's settings).

``AREAL_FAULT_DIR``: a directory shared by the test and every reward worker.
Each reward call appends ``<answer> <outcome>`` to ``calls.log`` there, so the
test can count what the kernel should have counted. ``hang_first_reward``
claims the first ``AREAL_FAULT_HANGS`` calls with marker files created with
O_EXCL (atomic across worker processes and restarts).
"""
from __future__ import annotations

import dataclasses
import os
import time

from pydantic import BaseModel, ConfigDict

from areal_kernel.workflow.rlvr import RLVRWorkflow


class NanLossSettings(BaseModel):
    """``algorithm.fault_nan_ppo``."""

    model_config = ConfigDict(extra="forbid")
    nan_steps: list[int] = []


def _log(answer: str, outcome: str) -> None:
    d = os.environ.get("AREAL_FAULT_DIR")
    if d:
        # One short O_APPEND write per line: lines from concurrent workers do not interleave.
        with open(os.path.join(d, "calls.log"), "a", encoding="utf-8") as f:
            f.write(f"{answer} {outcome}\n")


def raise_some_reward(completion: str, answer: str, **kwargs) -> float:
    if int(answer) % 4 == 3:
        _log(answer, "raise")
        raise ValueError(f"injected reward failure for answer {answer}")
    _log(answer, "ok")
    return 1.0


def always_raise_reward(completion: str, answer: str, **kwargs) -> float:
    _log(answer, "raise")
    raise RuntimeError("injected reward failure (always)")


def spread_reward(completion: str, answer: str, **kwargs) -> float:
    """Different completions get different rewards, so every GRPO group has
    non-zero advantages and every applied step changes the weights."""
    import zlib

    return (zlib.crc32(completion.encode("utf-8")) % 1000) / 1000.0


def _claim_hang() -> bool:
    d = os.environ["AREAL_FAULT_DIR"]
    for i in range(int(os.environ.get("AREAL_FAULT_HANGS", "0"))):
        try:
            os.close(os.open(os.path.join(d, f"hang{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            continue
    return False


def hang_first_reward(completion: str, answer: str, **kwargs) -> float:
    if _claim_hang():
        _log(answer, "hang")
        time.sleep(3600)  # far past reward.timeout_s: the pool must kill this worker
    _log(answer, "ok")
    return 1.0


_step = {"n": 0, "marker": None}


def nan_ppo_loss(logprobs, data, *, nan_steps, knobs, **kwargs):
    """The built-in ppo loss, times NaN on the (1-based) training steps in
    ``nan_steps``. A step is one ``train_batch`` call: every micro-batch of a
    call shares the same ``batch_loss_tokens`` tensor object (held here, so
    a new call's tensor cannot be mistaken for it)."""
    from areal_kernel.algo.losses import ppo_actor_loss

    marker = data.get("batch_loss_tokens")
    if marker is not _step["marker"]:
        _step["marker"] = marker
        _step["n"] += 1
    loss, stats = ppo_actor_loss(logprobs, data, knobs=knobs, **kwargs)
    if _step["n"] in set(nan_steps):
        loss = loss * float("nan")
    return loss, stats


class HotSamplerSettings(BaseModel):
    """``workflow.fault_hot_rlvr``."""

    model_config = ConfigDict(extra="forbid")
    temperature_factor: float = 2.0


class HotSamplerWorkflow(RLVRWorkflow):
    """The built-in rlvr workflow, but the servers are asked to sample at
    another temperature than the run's (the trainer scores with the
    configured one): the silent fault the mismatch monitor must catch."""

    @classmethod
    def from_context(cls, context):
        factor = context.settings.temperature_factor
        hot = dataclasses.replace(context.gconfig, temperature=context.gconfig.temperature * factor)
        return cls(
            tokenizer=context.tokenizer, gconfig=hot, reward_target=context.reward.target,
            reward_pool=context.reward_pool,
        )  # fmt: skip
