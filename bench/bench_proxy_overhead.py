"""Agent throughput through the OpenAI-compatible proxy vs the kernel's
inference client directly, on the same embedded server and prompts.

    OMP_NUM_THREADS=1 python bench/bench_proxy_overhead.py [--model DIR] [--agents 8]
        [--questions 32] [--new-tokens 48] [--rounds 2]

Both sides run the same agents: ``--agents`` concurrent workers take
``--questions`` arithmetic questions from a queue and ask each once. The
direct side renders the chat template and calls ``RemoteInferenceEngine.
agenerate``; the proxy side opens one session per question and asks with the
official ``openai`` client (chat template, tokenisation, session recording,
HTTP and JSON on top). Every request carries the same seed on both sides, so
both generate exactly the same tokens and tokens/s compares only the cost of
the path. Rounds alternate direct, proxy, direct, proxy; the table shows each
and the ratio of the mean rates (goal >= 0.9). The default model is
SmolLM2-135M-Instruct (offline); ``--model`` takes any HF directory with a
chat template.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def questions(n: int) -> list[str]:
    return [f"What is {i % 10} + {(i * 7) % 10}? Explain step by step." for i in range(n)]


async def run_direct(engine, tokenizer, qs: list[str], agents: int, new_tokens: int, stop: list[int]) -> tuple[float, int]:
    from areal_kernel.api.io import GenerationConfig, ModelRequest

    todo = asyncio.Queue()
    for i, q in enumerate(qs):
        todo.put_nowait((i, q))
    produced = 0

    async def agent() -> None:
        nonlocal produced
        while not todo.empty():
            i, q = todo.get_nowait()
            ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            prompt = tokenizer(ids, add_special_tokens=False)["input_ids"]
            g = GenerationConfig(max_new_tokens=new_tokens, temperature=1.0, seed=1000 + i, stop_token_ids=stop)
            resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g))
            tokenizer.decode(resp.output_ids, skip_special_tokens=True)  # an agent reads the answer
            produced += len(resp.output_ids)

    t = time.perf_counter()
    await asyncio.gather(*(agent() for _ in range(agents)))
    return time.perf_counter() - t, produced


async def run_proxy(proxy, qs: list[str], agents: int, new_tokens: int) -> tuple[float, int]:
    import aiohttp
    from openai import AsyncOpenAI

    todo = asyncio.Queue()
    for i, q in enumerate(qs):
        todo.put_nowait((i, q))
    produced = 0

    async def agent(http) -> None:
        nonlocal produced
        while not todo.empty():
            i, q = todo.get_nowait()
            async with http.post(f"{proxy.url}/sessions", json={}) as r:
                s = await r.json()
            client = AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
            out = await client.chat.completions.create(
                model="areal", messages=[{"role": "user", "content": q}], max_tokens=new_tokens, temperature=1.0,
                seed=1000 + i,
            )
            await client.close()
            async with http.post(f"{proxy.url}/sessions/{s['session_id']}/end",
                                 headers={"Authorization": f"Bearer {s['api_key']}"}) as r:
                await r.read()
            produced += out.usage.completion_tokens

    t = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(agent(http) for _ in range(agents)))
    return time.perf_counter() - t, produced


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="HF model directory with a chat template (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import logging

    for name in ("httpx", "httpx2", "openai"):  # one line per request would bury the table
        logging.getLogger(name).setLevel(logging.WARNING)

    from transformers import AutoTokenizer

    from areal_kernel.agent.config import ProxyConfig
    from areal_kernel.agent.proxy import AgentProxy
    from areal_kernel.api.io import GenerationConfig
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
    from areal_kernel.models.resolve import resolve_model_path

    model_dir = args.model or resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=tempfile.mkdtemp(prefix="bench-proxy-"))
    infos = launcher.launch(model_dir, n_servers=1, devices_per_server=0)
    engine = RemoteInferenceEngine([i.address for i in infos], EmbeddedProtocol())
    proxy = AgentProxy(tokenizer, ProxyConfig(tool_parser="hermes"), GenerationConfig(max_new_tokens=args.new_tokens),
                       engine=engine)  # fmt: skip
    proxy.start()
    qs = questions(args.questions)
    rows: list[tuple[str, int, float, int]] = []
    try:
        async def warm() -> None:
            await run_direct(engine, tokenizer, qs[:2], 2, 4, stop)
            await run_proxy(proxy, qs[:2], 2, 4)

        asyncio.run(warm())
        for r in range(args.rounds):
            dt, n = asyncio.run(run_direct(engine, tokenizer, qs, args.agents, args.new_tokens, stop))
            rows.append(("kernel client", r, dt, n))
            dt, n = asyncio.run(run_proxy(proxy, qs, args.agents, args.new_tokens))
            rows.append(("proxy + openai client", r, dt, n))
    finally:
        proxy.stop()
        engine.destroy()
        launcher.stop()
    print(f"\nmodel {model_dir}; {args.questions} questions, {args.agents} concurrent agents, "
          f"<= {args.new_tokens} new tokens each, seeded (both sides generate the same tokens)")  # fmt: skip
    print(f"{'path':<24} {'round':>5} {'seconds':>8} {'tokens':>7} {'tokens/s':>9}")
    for name, r, dt, n in rows:
        print(f"{name:<24} {r:>5} {dt:>8.2f} {n:>7} {n / dt:>9.1f}")
    direct = [n / dt for name, _, dt, n in rows if name == "kernel client"]
    via = [n / dt for name, _, dt, n in rows if name != "kernel client"]
    tokens = {n for _, _, _, n in rows}
    assert len(tokens) == 1, f"the two paths generated different token counts: {sorted(tokens)}"
    ratio = (sum(via) / len(via)) / (sum(direct) / len(direct))
    print(f"{'mean':<24} {'':>5} {'':>8} {'':>7} direct {sum(direct) / len(direct):.1f}, proxy {sum(via) / len(via):.1f}")
    report("agent tokens/s: proxy / kernel client", ratio, goal=0.9)


if __name__ == "__main__":
    main()
