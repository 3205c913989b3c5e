"""The vocabulary split of tensor parallelism (``fsdp:t2``): the embedding
and the LM head split by vocabulary rows over the tensor ranks, the logprobs
and entropies computed from each rank's slice of the logits.

- ``vocab_parallel_scores`` on 2 gloo ranks against one process: values and
  gradients (logprob alone, logprob and entropy) within a floor measured here
  (float32 against float64 on one process). The logits are scaled so that
  ``exp`` overflows float32 without the shared max: a per-rank max (the
  reduction left out) fails, and so does a missing sum.
- An untied model splits its embedding and head separately (both halved on
  each rank) and trains like the single-process engine; a vocabulary that
  does not divide by t keeps them replicated (the fallback) and trains
  alike too. The tied case is ``test_fsdp_tp`` (its tiny Llama ties them).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from fsdp_parity_helpers import CFG, LOSS, MULTIPLE, STEP_BATCHES, step_batch

from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.testing.models import make_tiny_llama
from areal_kernel.testing.noise import assert_within_noise, measure_noise_floor
from areal_kernel.testing.rank_engines import ppo_step_inputs
from areal_kernel.utils.network import find_free_port

pytestmark = pytest.mark.slow

VOCAB, ROWS, SCALE = 10, 7, 40.0
NOISE_SPLITS = (13, 17, 11)


def _reference(z: torch.Tensor, labels: torch.Tensor, w_lp: torch.Tensor, w_ent: torch.Tensor | None) -> list:
    """One process, the kernel runner's formulas: logprobs, entropies and the
    gradient of ``lp @ w_lp (+ ent @ w_ent)`` in ``z``'s dtype."""
    z = z.clone().requires_grad_()
    lse = torch.logsumexp(z, -1)
    lp = z.gather(-1, labels[:, None])[:, 0] - lse
    ent = lse - (torch.softmax(z, -1) * z).sum(-1)
    obj = lp @ w_lp + (ent @ w_ent if w_ent is not None else 0.0)
    obj.backward()
    return [lp.detach(), ent.detach(), z.grad]


def _inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(ROWS, VOCAB, generator=g, dtype=torch.float64) * SCALE
    labels = torch.tensor([0, 9, 4, 5, 2, 7, 5])  # on both ranks' halves
    w_lp = torch.randn(ROWS, generator=g, dtype=torch.float64)
    w_ent = torch.randn(ROWS, generator=g, dtype=torch.float64)
    return z, labels, w_lp, w_ent


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from areal_fsdp.tensor_parallel import vocab_parallel_scores

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        z, labels, w_lp, w_ent = _inputs()
        half = VOCAB // 2
        results = []
        for with_entropy in (False, True):
            zl = z[:, rank * half : (rank + 1) * half].float().clone().requires_grad_()
            lp, ent = vocab_parallel_scores(zl, labels, rank * half, None)
            obj = lp @ w_lp.float() + (ent @ w_ent.float() if with_entropy else 0.0)
            obj.backward()
            grads = [torch.zeros(ROWS, half) for _ in range(2)]
            dist.all_gather(grads, zl.grad)
            results.append([lp.detach(), ent.detach(), torch.cat(grads, dim=-1)])
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_scores_match_one_process(tmp_path):
    out = str(tmp_path / "scores.pt")
    mp.spawn(_rank, args=(find_free_port(), out), nprocs=2)
    got = torch.load(out, weights_only=True)  # tensors only: no pickled code runs
    z, labels, w_lp, w_ent = _inputs()
    assert torch.isinf(z.float().exp()).any()  # the shared max is needed
    for (lp, ent, grad), w in zip(got, (None, w_ent)):
        exact = _reference(z, labels, w_lp, w)
        f32 = _reference(z.float(), labels, w_lp.float(), w.float() if w is not None else None)
        for name, a, b, c in zip(("logprobs", "entropy", "logit gradient"), (lp, ent, grad), exact, f32):
            floor = measure_noise_floor(name, b.double().tolist(), c.double().tolist())
            print(assert_within_noise(a.double().tolist(), b.tolist(), floor, MULTIPLE))


def _against_torch(model_dir: str, steps: int = len(STEP_BATCHES)) -> tuple:
    """fsdp:t2 and the torch engine (plus ones with other micro-batch splits:
    the floor, the largest of them) trained ``steps`` steps on the same
    batches; returns the t2 engine (alive: the caller destroys it) and the
    reference. Several splits, as in test_fsdp_tp's Qwen check: Adam turns a
    near-zero gradient's rounding into a visible update, and one split
    samples that thinly. On the untied tiny Llama one element,
    ``lm_head.weight[32, 38]``, tops every path's difference (splits
    5.8e-7..2.1e-6, t2 7.1e-6 = 3.5x the floor); every other head element
    stays below 2.5e-7 on all of them, t2 included."""
    from areal_fsdp.engine import FSDPTrainEngine

    tp = FSDPTrainEngine(CFG, allocation="fsdp:t2")
    tp.initialize(model_dir, 10)
    ref = TorchTrainEngine(CFG)
    noises = [TorchTrainEngine({**CFG, "max_tokens_per_mb": mb}) for mb in NOISE_SPLITS]
    for e in (ref, *noises):
        e.initialize(model_dir, 10)
    history = []
    for seed, lengths in enumerate(STEP_BATCHES[:steps]):
        batch = step_batch(seed, lengths)
        history.append([e.train_batch(batch, LOSS, ppo_step_inputs(batch, e)) for e in (tp, ref, *noises)])
    for k in ("loss", "grad_norm"):
        want_k = [h[1][k] for h in history]
        floor = max(
            (measure_noise_floor(k, want_k, [h[2 + i][k] for h in history], relative=True) for i in range(len(noises))),
            key=lambda f: f.value,
        )
        print(assert_within_noise([h[0][k] for h in history], want_k, floor, MULTIPLE))
    want = dict(ref.named_weights_for_transfer())
    floor = max(
        (measure_noise_floor("weights", want, dict(n.named_weights_for_transfer())) for n in noises),
        key=lambda f: f.value,
    )
    print(assert_within_noise(tp.full_weights(), want, floor, MULTIPLE))
    return tp, ref


def test_untied_model_splits_embedding_and_head_separately(tmp_path):
    model = make_tiny_llama(str(tmp_path / "untied"), tie_word_embeddings=False)
    tp, ref = _against_torch(model)
    try:
        assert tp.vocab_parallel
        whole = sum(p.numel() * p.element_size() for p in ref.model.parameters())
        emb = ref.model.get_input_embeddings().weight
        head = ref.model.get_output_embeddings().weight
        assert emb is not head
        vocab_bytes = (emb.numel() + head.numel()) * emb.element_size()
        # Both vocabulary matrices halved, on top of the split decoder layers.
        assert tp.rank_param_bytes[0] == tp.rank_param_bytes[1] < whole - vocab_bytes // 2
        assert set(tp.full_weights()) >= {"model.embed_tokens.weight", "lm_head.weight"}
    finally:
        tp.destroy()


def test_vocabulary_that_does_not_divide_stays_replicated(tmp_path):
    model = make_tiny_llama(str(tmp_path / "odd-vocab"), vocab_size=255)
    tp, ref = _against_torch(model)
    try:
        assert not tp.vocab_parallel
        emb = ref.model.get_input_embeddings().weight
        # The replicated embedding is whole on each tensor rank.
        assert tp.rank_param_bytes[0] > emb.numel() * emb.element_size()
    finally:
        tp.destroy()


def test_what_keeps_the_vocabulary_replicated(tmp_path):
    """The fallback's reasons (one line each, logged by the driver): a LoRA
    adapter on the LM head (its base and adapter would need a split of their
    own), a vocabulary that does not divide by t. A plain tiny Llama splits."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from areal_fsdp.tensor_parallel import vocab_split_refusal

    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama(str(tmp_path / "m")))
    assert vocab_split_refusal(model, 2) is None
    assert vocab_split_refusal(model, 3) == "the vocabulary (256) does not divide by t=3"
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    assert vocab_split_refusal(peft, 2) == "a LoRA adapter wraps the embedding or the LM head"
