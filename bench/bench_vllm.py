"""areal-vllm on one real vLLM server (SmolLM2-135M-Instruct, fp32, CPU):

1. rollout throughput through areal-vllm's client (the kernel's
   RemoteInferenceEngine + VLLMProtocol) vs a raw aiohttp client posting the
   same bodies to the same server, same prompts (greedy: identical work);
   target ratio >= 0.95;
2. weight-update latency, disk (safetensors save + vLLM reload_weights) vs in
   memory (gloo broadcast through vLLM's weight-transfer routes), with the
   kernel's own transports and torch train engine.

    .venv/bin/python bench/bench_vllm.py [--prompts 32] [--max-new-tokens 64] [--rounds 3] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from prompts import chat_prompt_ids  # bench/prompts.py
from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _prompts(model_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    questions = [f"What is {i % 10} + {(i * 7) % 10}? Explain briefly." for i in range(n)]
    return chat_prompt_ids(AutoTokenizer.from_pretrained(model_dir), questions)


async def _areal_round(engine, prompts, max_new: int) -> int:
    from areal_kernel.api.io import GenerationConfig, ModelRequest

    g = GenerationConfig(max_new_tokens=max_new, greedy=True)
    try:
        rs = await asyncio.gather(*(engine.agenerate(ModelRequest(p, g)) for p in prompts))
    finally:
        await engine.aclose(current_loop_only=True)
    return sum(r.output_len for r in rs)


async def _raw_round(address: str, prompts, max_new: int) -> int:
    """A plain client: one aiohttp session, one POST per prompt, read token ids."""
    import aiohttp

    from areal_kernel.api.io import GenerationConfig
    from areal_vllm.protocol import VLLMProtocol

    proto = VLLMProtocol()
    g = GenerationConfig(max_new_tokens=max_new, greedy=True)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:

        async def one(i: int, p: list[int]) -> int:
            body = proto.generate(f"raw-{time.monotonic_ns()}-{i}", p, g, max_new).json
            async with sess.post(f"http://{address}/inference/v1/generate", json=body) as r:
                data = await r.json()
            return len(data["choices"][0]["token_ids"])

        return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def main() -> None:
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.models.resolve import resolve_model_path
    from areal_kernel.trainer.weight_sync import BroadcastTransport, DiskTransport
    from areal_vllm.config import VLLMServerConfig
    from areal_vllm.launcher import VLLMLauncher
    from areal_vllm.protocol import VLLMInferenceEngine, VLLMProtocol

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds per client (alternating)")
    ap.add_argument("--repeats", type=int, default=3, help="weight updates per transport")
    ap.add_argument("--model", default="smollm2-135m-instruct@float32")
    args = ap.parse_args()
    model_dir = resolve_model_path(args.model)
    prompts = _prompts(model_dir, args.prompts)
    with tempfile.TemporaryDirectory() as run_dir:
        launcher = VLLMLauncher(VLLMServerConfig(dtype="float32", max_model_len=1024), run_dir=run_dir)
        try:
            t0 = time.monotonic()
            (info,) = launcher.launch(model_dir, n_servers=1, devices_per_server=0)
            startup = time.monotonic() - t0
            client = VLLMInferenceEngine([info.address], VLLMProtocol())
            client.set_version(0)
            # Warm-up (first requests pay one-off costs on the server).
            asyncio.run(_raw_round(info.address, prompts[:4], 8))
            tps: dict[str, list[float]] = {"areal-vllm": [], "raw aiohttp": []}
            for _ in range(args.rounds):
                for name in ("raw aiohttp", "areal-vllm"):
                    t = time.monotonic()
                    if name == "raw aiohttp":
                        n = asyncio.run(_raw_round(info.address, prompts, args.max_new_tokens))
                    else:
                        n = asyncio.run(_areal_round(client, prompts, args.max_new_tokens))
                    tps[name].append(n / (time.monotonic() - t))
            engine = TorchTrainEngine({"lr": 1e-6, "param_dtype": "float32"})
            engine.initialize(model_dir, 10)
            rows = []
            version = 0
            for cls in (DiskTransport, BroadcastTransport):
                tr = cls(engine, client, run_dir, 256 << 20)
                tr.setup()
                times, pauses, mb = [], [], 0.0
                for _ in range(args.repeats):
                    version += 1
                    t = time.monotonic()
                    m = tr.update(version)
                    times.append(time.monotonic() - t)
                    pauses.append(m.get("weights/pause_s", 0.0))
                    mb = m["weights/mb"]
                med = statistics.median(times)
                rows.append((cls.name, med, statistics.median(pauses), mb, mb / med))
                tr.close()
            client.destroy()
        finally:
            launcher.stop()
    med = {k: statistics.median(v) for k, v in tps.items()}
    print(f"\nvLLM server start to /health: {startup:.1f} s")
    print(f"\nRollout throughput, {args.prompts} prompts x {args.max_new_tokens} new tokens, greedy, "
          f"median of {args.rounds} rounds")  # fmt: skip
    print("| client | tokens/s (median) | rounds |")
    print("|---|---|---|")
    for k in ("raw aiohttp", "areal-vllm"):
        print(f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in tps[k])} |")
    print(f"\nareal-vllm / raw throughput ratio: {med['areal-vllm'] / med['raw aiohttp']:.3f} (target >= 0.95)")
    print(f"\nWeight update, SmolLM2-135M fp32, median of {args.repeats}")
    print("| transport | total s | servers paused s | MB | MB/s |")
    print("|---|---|---|---|---|")
    for name, s, pause, mb, rate in rows:
        print(f"| {name} | {s:.2f} | {pause:.2f} | {mb:.0f} | {rate:.0f} |")
    print(f"\ndisk / in-memory latency ratio: {rows[0][1] / rows[1][1]:.2f}")
    report("areal-vllm client / raw aiohttp tokens/s", med["areal-vllm"] / med["raw aiohttp"], 0.95)
    report("vLLM weight update: disk / in-memory seconds", rows[0][1] / rows[1][1])


if __name__ == "__main__":
    main()
