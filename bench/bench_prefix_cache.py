"""The embedded server's prefix cache on the main job's requests: on vs off.

The workload is what the main job (``examples/grpo_arithmetic.yaml`` and the
LoRA runs) sends: SmolLM2-135M-Instruct, each arithmetic question rendered
with the model's chat template (whose system prompt every prompt shares), 8
samples per question, 12 new tokens, temperature 0.7, ``--concurrent``
questions in flight (a new one is sent as soon as one finishes). Half the
questions are then sent again as a weight update leaves them: prompt plus
the first tokens already generated (what an interrupted rollout resumes
with). The same requests go to one server with the cache (the default) and
one started with ``--no-prefix-cache``, one after the other, twice each,
interleaved; each side's best run counts.

Printed: wall seconds, samples/s, the prompt tokens the cache served
(``/info``'s ``prefix_cache``) and the ratio of samples/s, cache on / off.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_prefix_cache.py [--questions 24] [--concurrent 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request

from prompts import chat_prompt_ids  # bench/prompts.py
from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

N_SAMPLES = 8
NEW_TOKENS = 12


def prompts(model_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    rng = random.Random(0)
    questions = []
    for _ in range(n):
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-")
        questions.append(f"What is {a} {op} {b}? Answer with just the number.")
    return chat_prompt_ids(AutoTokenizer.from_pretrained(model_dir), questions)


async def workload(address: str, questions: list[list[int]], concurrent: int) -> tuple[float, int]:
    """Every question's 8 samples, then half of them resumed; (seconds, samples)."""
    import aiohttp

    counter = iter(range(10**9))

    async with aiohttp.ClientSession() as s:

        async def one(ids: list[int], n: int, seed: int) -> list[int]:
            body = {"rid": f"p{next(counter)}", "input_ids": ids,
                    "sampling_params": {"max_new_tokens": n, "temperature": 0.7, "seed": seed}}  # fmt: skip
            async with s.post(f"http://{address}/generate", json=body) as r:
                out = await r.json()
                assert r.status == 200, out
                return out["output_ids"]

        gate = asyncio.Semaphore(concurrent)

        async def group(q: int, ids: list[int]) -> list[list[int]]:
            async with gate:
                return await asyncio.gather(*(one(ids, NEW_TOKENS, q * 100 + k) for k in range(N_SAMPLES)))

        t = time.perf_counter()
        outs = await asyncio.gather(*(group(q, ids) for q, ids in enumerate(questions)))

        async def resumed(q: int, ids: list[int], firsts: list[list[int]]) -> None:
            async with gate:
                await asyncio.gather(
                    *(one(ids + f[:4], NEW_TOKENS - 4, q * 100 + k) for k, f in enumerate(firsts) if len(f) > 4)
                )

        half = range(0, len(questions), 2)
        await asyncio.gather(*(resumed(q, questions[q], outs[q]) for q in half))
        dt = time.perf_counter() - t
    n = len(questions) * N_SAMPLES + sum(1 for q in half for f in outs[q] if len(f) > 4)
    return dt, n


def info(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/info", timeout=30) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--concurrent", type=int, default=2, help="questions in flight (x8 samples)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
    from areal_kernel.models.resolve import resolve_model_path

    model_dir = resolve_model_path(args.model)
    questions = prompts(model_dir, args.questions)
    common = os.path.commonprefix(questions)
    launchers = {on: EmbeddedLauncher(EmbeddedServerConfig(prefix_cache=on)) for on in (True, False)}
    best: dict[bool, tuple[float, int]] = {}
    reused: dict[bool, int] = {}
    try:
        addresses = {}
        for on, launcher in launchers.items():
            (srv,) = launcher.launch(model_dir, 1, 0)
            addresses[on] = srv.address
        for _ in range(args.repeats):
            for on in (True, False):
                dt, n = asyncio.run(workload(addresses[on], questions, args.concurrent))
                if on not in best or n / dt > best[on][1] / best[on][0]:
                    best[on] = (dt, n)
        for on in (True, False):
            stats = info(addresses[on]).get("prefix_cache") or {}
            reused[on] = int(stats.get("prefix_reused_tokens", 0))
    finally:
        for launcher in launchers.values():
            launcher.stop()

    print(f"{args.model}: {args.questions} questions x {N_SAMPLES} samples, {NEW_TOKENS} new tokens, "
          f"{args.concurrent} questions in flight, half resumed after 4 tokens; prompts {len(questions[0])} tokens, "
          f"{len(common)} shared by all; best of {args.repeats}, OMP_NUM_THREADS=1")  # fmt: skip
    print("| server | wall s | samples | samples/s | prompt tokens served from the cache (all runs) |")
    print("|---|---|---|---|---|")
    for on in (True, False):
        dt, n = best[on]
        print(f"| prefix cache {'on' if on else 'off'} | {dt:.1f} | {n} | {n / dt:.2f} | {reused[on]} |")
    ratio = (best[True][1] / best[True][0]) / (best[False][1] / best[False][0])
    print(f"prefix cache on / off, samples/s: {ratio:.2f}x")
    report("embedded server prefix cache: samples/s on / off", ratio, 1.0)


if __name__ == "__main__":
    main()
