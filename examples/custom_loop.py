"""A training loop of your own, built from the kernel's public API
(docs/api.md), without ``areal train``.

    OMP_NUM_THREADS=1 python examples/custom_loop.py --steps 4 --out /tmp/custom-loop

What it wires together, each piece from its public module:

- a tiny random Llama written to ``<out>/model`` (``areal_kernel.testing.models``);
  pass ``--model DIR`` to use your own HF model directory instead;
- one embedded inference server: a real separate process serving the model
  over HTTP on 127.0.0.1 (``EmbeddedLauncher``), and the generic remote
  client that talks to it (``RemoteInferenceEngine``);
- a workflow of our own (``TokenTargetWorkflow`` below): sample a group of
  completions per prompt and score them with a reward of our own (the share
  of generated tokens below ``--target-below``; replace it with yours);
- the rollout executor (``RolloutExecutor``): episodes run concurrently on
  a background asyncio loop, at most ``--max-staleness`` weight versions ahead;
- the torch train engine (``TorchTrainEngine``) and one RL step per batch
  (``rl_train_step`` with ``RLConfig``: GRPO advantages, PPO loss);
- a disk weight transport (``DiskTransport``): after each step the server
  reloads the new weights and stamps the next tokens with the new version.

It prints one line per step and writes ``<out>/summary.json``. Runs on a CPU
in well under a minute with the tiny model.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import time
from typing import Any

from areal_kernel.algo.rl import RLConfig, rl_train_step
from areal_kernel.api.io import GenerationConfig, ModelRequest, Trajectory, TrajectoryBatch, TrajectoryGroup
from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.inference.client import RemoteInferenceEngine
from areal_kernel.inference.embedded.backend import EmbeddedProtocol
from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
from areal_kernel.rollout.executor import RolloutExecutor
from areal_kernel.trainer.weight_sync import DiskTransport


def token_share_reward(output_ids: list[int], below: int) -> float:
    """Our reward: the share of generated tokens whose id is below ``below``."""
    return sum(1 for t in output_ids if t < below) / max(len(output_ids), 1)


class TokenTargetWorkflow:
    """One episode: ``n_samples`` completions of a record's prompt, each scored.

    Any object with ``async arun_episode(engine, record) -> TrajectoryGroup | None``
    is a workflow for the executor."""

    def __init__(self, gconfig: GenerationConfig, below: int) -> None:
        self.gconfig = gconfig
        self.below = below

    async def arun_episode(self, engine: Any, record: dict[str, Any]) -> TrajectoryGroup:
        reqs = [ModelRequest(input_ids=record["prompt_ids"], gconfig=self.gconfig) for _ in range(self.gconfig.n_samples)]
        resps = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
        trajs = [
            Trajectory.from_response(r, token_share_reward(r.output_ids, self.below), group_id=record["id"],
                                     sample_id=f"{record['id']}#{i}")
            for i, r in enumerate(resps)
        ]  # fmt: skip
        return TrajectoryGroup(trajs, group_id=record["id"])


async def _generate(client: RemoteInferenceEngine, prompt_ids: list[int], gconfig: GenerationConfig) -> Any:
    try:
        return await client.agenerate(ModelRequest(input_ids=prompt_ids, gconfig=gconfig))
    finally:
        await client.aclose(current_loop_only=True)  # this loop's HTTP session


def prompts(vocab: int, seed: int):
    """Endless random prompts of 4-8 token ids (a real run reads a dataset)."""
    rng = random.Random(seed)
    for i in itertools.count():
        yield {"id": f"p{i}", "prompt_ids": [rng.randrange(vocab) for _ in range(rng.randint(4, 8))]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/custom-loop", help="run directory (model, server logs, weights, summary)")
    p.add_argument("--model", help="an HF model directory (default: a tiny random Llama written to <out>/model)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4, help="prompts (groups) per step")
    p.add_argument("--n-samples", type=int, default=4, help="completions per prompt (the GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--target-below", type=int, default=32, help="the reward counts generated token ids below this")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    model_dir = args.model
    if model_dir is None:
        from areal_kernel.testing.models import make_tiny_llama

        model_dir = make_tiny_llama(os.path.join(args.out, "model"), seed=args.seed)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]

    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=args.out)
    client = train = executor = None
    try:
        servers = launcher.launch(model_dir, n_servers=1, devices_per_server=0)
        client = RemoteInferenceEngine([s.address for s in servers], EmbeddedProtocol())
        # The sampler and the trainer must use the same temperature (logprob ratios compare them).
        gconfig = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, n_samples=args.n_samples)
        train = TorchTrainEngine({"lr": args.lr, "seed": args.seed, "temperature": gconfig.temperature})
        train.initialize(model_dir, args.steps)
        transport = DiskTransport(train, client, args.out)
        transport.setup()
        rl = RLConfig(advantage="grpo", loss="ppo", temperature=gconfig.temperature, max_new_tokens=args.max_new_tokens)
        stream = prompts(vocab, args.seed)
        executor = RolloutExecutor(
            client, TokenTargetWorkflow(gconfig, args.target_below), lambda: next(stream),
            batch_size=args.batch_size, max_staleness=args.max_staleness, max_concurrent=2 * args.batch_size,
        )  # fmt: skip
        name, first = train.named_weights_for_transfer()[0]
        before = first.detach().clone()
        executor.start()
        version, history = 0, []
        t0 = time.monotonic()
        for step in range(1, args.steps + 1):
            groups = executor.get_batch(args.batch_size)
            batch = TrajectoryBatch.from_groups(groups)
            stats = rl_train_step(batch, train, rl)
            version += 1
            transport.update(version)  # the server now samples with the new weights
            train.set_version(version)
            executor.set_version(version)
            token_versions = sorted({v for t in batch.trajectories for v, m in zip(t.versions, t.loss_mask) if m})
            history.append({"step": step, "reward": stats["reward"], "loss": stats["loss"],
                            "token_versions": token_versions})  # fmt: skip
            print(f"step {step}: reward {stats['reward']:.3f} loss {stats['loss']:+.4f} "
                  f"(trained tokens from weight versions {token_versions})", flush=True)  # fmt: skip
        executor.stop()
        after = dict(train.named_weights_for_transfer())[name]
        # One more generation: the server stamps its tokens with the weights it now holds.
        probe = asyncio.run(_generate(client, next(stream)["prompt_ids"], gconfig))
        summary = {
            "steps": len(history),
            "version": version,
            "server_token_versions": sorted(set(probe.output_versions)),
            "weights_changed": bool((after - before).abs().max().item() > 0),
            "history": history,
            "seconds": time.monotonic() - t0,
        }
    finally:
        if executor is not None:
            executor.stop()
        if client is not None:
            client.destroy()
        launcher.stop()
        if train is not None:
            train.destroy()
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(f"done: {summary['steps']} steps, weights version {summary['version']}, summary in "
          f"{os.path.join(args.out, 'summary.json')}", flush=True)  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
