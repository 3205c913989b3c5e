"""The embedded server's prefix cache (``areal_kernel.inference.embedded.prefix``)
on a tiny random Llama in this process: rows that share a prompt prefix
reuse its KV, computed once per weight version and adapter, and generate
what a whole prefill generates; a weight or adapter update drops the cached
KV (the control: keeping it is caught)."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from areal_kernel.inference.embedded.engine import GenerationEngine  # noqa: E402
from areal_kernel.inference.embedded.protocol import GenerateBody, parse_sampling  # noqa: E402
from areal_kernel.models.tiny import make_tiny_llama  # noqa: E402
from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor  # noqa: E402
from trained_engine import random_adapter  # noqa: E402

# The server against a full forward of the same weights: within this multiple
# of the floor (the full forward with eager attention instead of sdpa), as
# in test_embedded_lora.py; a stale prefix KV is off by far more.
MULTIPLE = 8.0
N_NEW = 8
PREFIX = [int(x) for x in torch.randint(3, 250, (20,), generator=torch.Generator().manual_seed(0))]
# Tails of different lengths (the padding sits between prefix and tail) and
# different first tokens (the rows' common prefix is PREFIX itself).
TAILS = [[7, 9, 11], [13, 8, 6, 4, 2], [250, 1, 2, 3, 4, 5, 6, 7], [99, 98]]
_RIDS = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), layers=2)


def _model(model_dir, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()


def _engine(model, prefix_cache: bool) -> GenerationEngine:
    eng = GenerationEngine(model, max_batch_size=16, eos_ids=[], max_positions=512,
                           vocab_size=model.config.vocab_size, device=torch.device("cpu"),
                           prefix_cache=prefix_cache)  # fmt: skip
    eng.start()
    return eng


def _generate(engine: GenerationEngine, prompts, adapters=None) -> list[dict]:
    """All prompts admitted together (one prefill), greedy."""
    adapters = adapters or [None] * len(prompts)
    engine.pause("keep").result(10)
    params = parse_sampling({"max_new_tokens": N_NEW, "greedy": True})
    futs = [engine.submit(GenerateBody(f"r{next(_RIDS)}", p, params, adapter=a)) for p, a in zip(prompts, adapters)]
    engine.resume().result(10)
    return [f.result(60) for f in futs]


def _recompute(model, prompt: list[int], out: dict) -> list[float]:
    ids = prompt + out["output_ids"]
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [logp[i - 1, ids[i]].item() for i in range(len(prompt), len(ids))]


def _check_against_forward(model, eager, prompts, outs, what: str) -> None:
    eager.load_state_dict(model.state_dict())
    want = [_recompute(model, p, o) for p, o in zip(prompts, outs)]
    floor = measure_noise_floor(
        "logprobs, sdpa vs eager", want, [_recompute(eager, p, o) for p, o in zip(prompts, outs)]
    )
    print(assert_within_noise([o["output_logprobs"] for o in outs], want, floor, MULTIPLE, what=what))


def test_rows_sharing_a_prefix_reuse_its_kv_and_generate_what_a_whole_prefill_does(model_dir):
    cached_model, whole_model, eager = _model(model_dir), _model(model_dir), _model(model_dir, "eager")
    cached, whole = _engine(cached_model, True), _engine(whole_model, False)
    try:
        prompts = [PREFIX + t for t in TAILS]
        got, want = _generate(cached, prompts), _generate(whole, prompts)
        assert cached.prefix is not None and whole.prefix is None
        # Learned from the batch itself: the rows' longest common prefix.
        assert cached.prefix.tokens == tuple(PREFIX)
        assert cached.prefix.stats()["prefix_reused_tokens"] == len(PREFIX) * len(TAILS)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        _check_against_forward(cached_model, eager, prompts, got, "prefix-cached prefill vs a full forward")

        # A later batch (other tails, and a row resumed after an interruption:
        # prompt plus tokens already generated) takes the KV from the cache.
        kv_before = cached.prefix.kv[None][0][0]
        later = [PREFIX + [31, 32], PREFIX + TAILS[1] + got[1]["output_ids"][:3], PREFIX + [5] * 9]
        got2, want2 = _generate(cached, later), _generate(whole, later)
        assert cached.prefix.kv[None][0][0] is kv_before  # not computed again
        assert cached.prefix.stats()["prefix_rows"] == len(TAILS) + len(later)
        assert [o["output_ids"] for o in got2] == [o["output_ids"] for o in want2]
        _check_against_forward(cached_model, eager, later, got2, "cached prefix, later batch")

        # A row that shares fewer tokens (but enough) shortens the prefix; one
        # that shares too few is prefilled whole beside the cached rows.
        short = PREFIX[:17] + [1, 2, 3]
        other = [200, 201, 202, 203]
        got3, want3 = _generate(cached, [short, other, PREFIX + [44]]), _generate(whole, [short, other, PREFIX + [44]])
        assert cached.prefix.tokens == tuple(PREFIX[:17])
        assert [o["output_ids"] for o in got3] == [o["output_ids"] for o in want3]
        _check_against_forward(cached_model, eager, [short, other, PREFIX + [44]], got3, "shortened prefix")
    finally:
        cached.shutdown()
        whole.shutdown()


def _perturb(model, seed: int):
    g = torch.Generator().manual_seed(seed)

    def load() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)

    return load


@pytest.mark.parametrize("keep_stale", [False, True], ids=["drops", "control-keeps-stale"])
def test_a_weight_update_drops_the_cached_kv(model_dir, keep_stale):
    model, eager = _model(model_dir), _model(model_dir, "eager")
    engine = _engine(model, True)
    try:
        prompts = [PREFIX + t for t in TAILS]
        _generate(engine, prompts)
        assert engine.prefix is not None and None in engine.prefix.kv
        if keep_stale:  # the control: a server that forgot to drop it
            engine.prefix.drop = lambda *a, **k: None  # type: ignore[method-assign]
        engine.update_weights(_perturb(model, 1), version=1).result(30)
        after = _generate(engine, prompts)
        assert engine.prefix.stats()["prefix_rows"] == 2 * len(TAILS)  # the new weights' prefix was cached too
        if keep_stale:
            with pytest.raises(AssertionError):
                _check_against_forward(model, eager, prompts, after, "stale prefix KV")
        else:
            _check_against_forward(model, eager, prompts, after, "after a weight update")
    finally:
        engine.shutdown()


def _load(engine: GenerationEngine, name: str, seed: int, version: int) -> None:
    tensors = random_adapter(engine.model, seed, scale=0.3)
    engine.load_adapter(
        name, lambda: engine.lora.load(name, {"r": 4, "lora_alpha": 8}, tensors, version), version
    ).result(30)


def test_each_adapter_has_its_own_prefix_kv_and_a_reload_drops_it(model_dir):
    cached, whole = _engine(_model(model_dir), True), _engine(_model(model_dir), False)
    try:
        for eng in (cached, whole):
            _load(eng, "a", 1, 1)
            _load(eng, "b", 2, 1)
        prompts = [PREFIX + t for t in TAILS] * 2
        rows = ["a", "b", None, "a", "b", None, "a", "b"]
        got, want = _generate(cached, prompts, rows), _generate(whole, prompts, rows)
        assert cached.prefix is not None and set(cached.prefix.kv) == {"a", "b", None}
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        # The adapters matter here: row i and row i + 4 hold one prompt under two
        # of (a, b, base), and their greedy answers are not all equal.
        assert any(got[i]["output_ids"] != got[i + 4]["output_ids"] for i in range(4))

        kept = cached.prefix.kv["b"][0][0]
        for eng in (cached, whole):
            _load(eng, "a", 3, 2)  # a's new weights: its cached KV must go, b's stays
        assert "a" not in cached.prefix.kv and cached.prefix.kv["b"][0][0] is kept
        got2, want2 = _generate(cached, prompts, rows), _generate(whole, prompts, rows)
        assert [o["output_ids"] for o in got2] == [o["output_ids"] for o in want2]
        assert [o["output_ids"] for o in got2] != [o["output_ids"] for o in got]  # a's reload changed a's rows
    finally:
        cached.shutdown()
        whole.shutdown()


def test_a_weight_load_that_fails_halfway_leaves_no_cached_kv(model_dir):
    """The KV is dropped before the load: a load that raised after copying
    some tensors leaves weights that no cached KV came from."""
    model = _model(model_dir)
    engine = _engine(model, True)
    try:
        _generate(engine, [PREFIX + t for t in TAILS])
        assert engine.prefix is not None and engine.prefix.kv

        def half_load() -> None:
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
            raise RuntimeError("the second shard is unreadable")

        with pytest.raises(RuntimeError, match="unreadable"):
            engine.update_weights(half_load, version=1).result(30)
        assert engine.prefix.kv == {}
    finally:
        engine.shutdown()


def test_with_the_cache_off_no_prefix_is_kept(model_dir):
    eng = _engine(_model(model_dir), False)
    try:
        _generate(eng, [PREFIX + t for t in TAILS])
        assert eng.prefix is None
    finally:
        eng.shutdown()
