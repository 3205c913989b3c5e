"""The generation engine in-process: requests joining a running batch (both
cache-length orders), rows leaving it, and greedy still equal to HF."""
from __future__ import annotations

import threading

import pytest
import torch

from areal_kernel.inference.embedded.engine import GenerationEngine
from areal_kernel.inference.embedded.protocol import GenerateBody, parse_sampling
from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor


@pytest.fixture(scope="module")
def engine(hf_model):
    eng = GenerationEngine(hf_model, max_batch_size=8, eos_ids=[], max_positions=4096,
                           vocab_size=hf_model.config.vocab_size, device=torch.device("cpu"))
    eng.start()
    yield eng
    eng.shutdown()


def greedy(model, prompt, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def body(rid, prompt, n):
    return GenerateBody(rid, prompt, parse_sampling({"max_new_tokens": n, "greedy": True}))


def run_until(engine, cond, timeout=60):
    """Let the engine step until ``cond()`` holds after a step, and leave it
    paused (keep) right there, so the test can inspect and submit
    deterministically. Step-exact: a timed resume/pause loop let a fast CPU
    finish a whole request between two looks (and then wait forever)."""
    engine.pause("keep").result(10)
    if cond():
        return
    reached = threading.Event()
    plain_step = engine._step

    def step_then_check():
        plain_step()
        if cond():
            engine.paused = True  # what pause("keep") does, between the same two steps
            reached.set()

    engine._step = step_then_check
    try:
        engine.resume().result(10)
        assert reached.wait(timeout), "the engine never reached the state the test waits for"
    finally:
        del engine._step


def test_joins_in_both_length_orders_and_leaves(engine, hf_model):
    a = engine.submit(body("a", [3, 1, 4], 60))
    run_until(engine, lambda: engine.batch is not None)
    la = engine.batch.length
    longer = [(11 * i) % 300 for i in range(la + 17)]  # new rows' cache longer than the batch's
    b = engine.submit(body("b", longer, 25))
    run_until(engine, lambda: engine.batch is not None and engine.batch.size == 2)
    assert engine.batch.mask is not None  # "a" got left-padded
    shorter = [9, 8]  # new row's cache shorter than the batch's
    c = engine.submit(body("c", shorter, 5))  # finishes first: its row leaves the batch
    engine.resume().result(10)
    ra, rb, rc = a.result(60), b.result(60), c.result(60)
    assert ra["output_ids"] == greedy(hf_model, [3, 1, 4], 60)
    assert rb["output_ids"] == greedy(hf_model, longer, 25)
    assert rc["output_ids"] == greedy(hf_model, shorter, 5)
    assert engine.batch is None and engine.n_running == 0


def test_batch_cap_queues_the_rest(engine, hf_model):
    prompts = [[i + 1] * (1 + i % 4) for i in range(12)]  # 12 requests, cap 8
    futs = [engine.submit(body(f"q{i}", p, 7)) for i, p in enumerate(prompts)]
    outs = [f.result(60) for f in futs]
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == greedy(hf_model, p, 7)


def test_duplicate_rid_rejected(engine):
    from areal_kernel.inference.embedded.protocol import RequestError

    engine.pause("keep").result(10)
    try:
        f1 = engine.submit(body("dup", [1, 2], 3))
        f2 = engine.submit(body("dup", [1, 2], 3))
        with pytest.raises(RequestError, match="dup"):
            f2.result(10)
    finally:
        engine.resume().result(10)
    assert len(f1.result(30)["output_ids"]) == 3


def test_areal_sdpa_equals_sdpa_on_a_padded_batch(tiny_model_dir, hf_model):
    from transformers import AutoModelForCausalLM

    from areal_kernel.inference.embedded.attention import register

    ours = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=register())
    ids = torch.randint(0, 384, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, :9] = 0
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = hf_model(input_ids=ids, attention_mask=mask).logits
        c = eager(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    # Floor (areal_kernel.testing.noise): transformers' eager attention against its sdpa.
    floor = measure_noise_floor("logits", b[keep], c[keep])
    print(assert_within_noise(a[keep], b[keep], floor, 4.0))


def test_growing_layer_matches_concatenation():
    from areal_kernel.inference.embedded.growcache import GrowingLayer

    g = torch.Generator().manual_seed(0)
    layer = GrowingLayer()
    ref_k = torch.empty(2, 3, 0, 4)
    for n in [5, 1, 1, 40, 1]:  # the 40 forces a regrow
        k, v = torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 4, generator=g)
        ref_k = torch.cat([ref_k, k], -2)
        keys, values = layer.update(k, v)
        assert torch.equal(keys, ref_k) and torch.equal(values[:, :, -n:], v)
        assert layer.get_seq_length() == ref_k.shape[-2]
    layer.set_kv(ref_k[:1, :, 10:], ref_k[:1, :, 10:])  # batch surgery
    keys, _ = layer.update(torch.ones(1, 3, 1, 4), torch.ones(1, 3, 1, 4))
    assert keys.shape == (1, 3, ref_k.shape[-2] - 10 + 1, 4)
    assert torch.equal(keys[:, :, :-1], ref_k[:1, :, 10:]) and torch.equal(keys[:, :, -1], torch.ones(1, 3, 4))


def test_identical_prompts_are_prefilled_once_and_sample_independently(engine, hf_model, hf_eager):
    """A GRPO group sends n copies of one prompt: the engine prefills the
    distinct prompts once (fewer prefill rows), yet every copy's greedy output
    and logprobs equal a lone request's, and sampled copies differ."""
    p, q = [5, 7, 11, 13, 17], [2, 4, 6]
    lone = engine.submit(body("lone", p, 6)).result(60)
    calls = []
    orig = engine._forward

    def counting(ids, mask, pos_ids, cache):
        calls.append(tuple(ids.shape))
        return orig(ids, mask, pos_ids, cache)

    engine._forward = counting
    try:
        engine.pause("keep").result(10)
        futs = [engine.submit(body(f"g{i}", p if i % 2 else q, 6)) for i in range(6)]
        engine.resume().result(10)
        outs = [f.result(60) for f in futs]
    finally:
        engine._forward = orig
    assert calls[0] == (2, 5)  # one prefill row per distinct prompt
    for i, o in enumerate(outs):
        assert o["output_ids"] == (lone["output_ids"] if i % 2 else greedy(hf_model, q, 6))
    # Floor: one full forward over the lone request's tokens, sdpa against eager.
    full = torch.tensor([p + lone["output_ids"]])
    with torch.inference_mode():
        lps = [m(full).logits[0, len(p) - 1 : -1].log_softmax(-1) for m in (hf_model, hf_eager)]
    floor = measure_noise_floor("logprobs", *(lp.gather(-1, full[0, len(p) :, None])[:, 0] for lp in lps))
    for o in outs[1::2]:
        print(assert_within_noise(o["output_logprobs"], lone["output_logprobs"], floor, 8.0))
    sampled = [
        engine.submit(GenerateBody(f"s{i}", p, parse_sampling({"max_new_tokens": 8, "temperature": 1.0})))
        for i in range(6)
    ]
    texts = {tuple(f.result(60)["output_ids"]) for f in sampled}
    assert len(texts) > 1


def _seeded(rid, prompt, n, seed):
    return GenerateBody(rid, prompt, parse_sampling({"max_new_tokens": n, "temperature": 1.0, "seed": seed}))


def test_seeded_requests_regenerate_the_same_tokens(engine):
    """What exact recovery relies on: a seeded request yields the same tokens
    alone, batched with other requests, and when cut in two (the second half
    sent as prompt + first half, as after an interruption); other seeds differ."""
    p = [5, 7, 11, 13, 17]
    lone = engine.submit(_seeded("lone", p, 12, 1234)).result(60)["output_ids"]
    engine.pause("keep").result(10)
    futs = [engine.submit(_seeded(f"b{i}", p if i else [2, 4, 6, 8], 12, 1234 if i == 1 else 77 + i)) for i in range(5)]
    engine.resume().result(10)
    batched = [f.result(60)["output_ids"] for f in futs]
    assert batched[1] == lone
    first = engine.submit(_seeded("h1", p, 5, 1234)).result(60)["output_ids"]
    second = engine.submit(_seeded("h2", p + first, 7, 1234)).result(60)["output_ids"]
    assert first + second == lone
    others = {tuple(engine.submit(_seeded(f"o{s}", p, 12, s)).result(60)["output_ids"]) for s in range(6)}
    assert len(others) > 1  # seeds matter: not a fixed sequence


def test_seeded_uniforms_are_uniform():
    from areal_kernel.inference.embedded.sampling import seeded_uniform

    draws = [seeded_uniform(s, p) for s in range(200) for p in range(50)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    deciles = [sum(1 for u in draws if k / 10 <= u < (k + 1) / 10) for k in range(10)]
    assert min(deciles) > 900 and max(deciles) < 1100  # 10,000 draws, ~1,000 per decile
    assert len(set(draws)) == len(draws)
