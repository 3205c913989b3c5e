"""Several LoRA adapters on one frozen base in the torch engine (``adapters:``):
each policy's view trains, scores, exports, sends and checkpoints its own
adapter as a one-adapter engine would, and leaves the others alone."""

from __future__ import annotations

import json
import os

import pytest
import torch
from engine_helpers import make_batch
from test_lora_engine import hf_logprobs
from test_torch_engine import LENGTHS, MULTIPLE, advantages_for, make_engine, max_abs_diff, ppo_like_loss
from transformers import AutoModelForCausalLM

from areal_kernel.algo.losses import make_ppo_loss_fn
from areal_kernel.api.engine import WeightUpdateMeta
from areal_kernel.engine.config import TorchEngineConfig
from areal_kernel.engine.lora import adapter_params, read_adapter_dir
from areal_kernel.errors import ConfigError, DataError
from areal_kernel.testing.noise import assert_within_noise, max_difference, measure_noise_floor
from areal_kernel.testing.rank_engines import state_round_trip

# Two adapters of different shapes and targets: nothing may rely on them matching.
LORA_A = {"name": "A", "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}
LORA_B = {"name": "b.v2", "rank": 2, "alpha": 4, "target_modules": ["k_proj", "o_proj"]}
# A decaying schedule: a step counter shared between the policies would give
# each other lrs than a one-adapter engine's.
COMMON = dict(total_steps=4, lr=1e-2, lr_scheduler="cosine")
X_SEEDS, Y_SEEDS = (10, 11, 12), (20, 21, 22)


def multi_engine(model_dir: str, adapters: list[dict] | None = None, **cfg):
    return make_engine(model_dir, adapters=adapters or [LORA_A, LORA_B], **COMMON, **cfg)


def single_engine(model_dir: str, lora: dict, init: dict[str, torch.Tensor], **cfg):
    """Today's one-adapter engine (``lora:``), started from the adapter
    weights ``init`` (peft file names): peft draws A's initial values from
    the RNG, which the multi-adapter engine consumed for every adapter."""
    e = make_engine(model_dir, lora=lora, **COMMON, **cfg)
    with torch.no_grad():
        params = adapter_params(e.model, "default")
        assert sorted(n for n, _ in params) == sorted(init)
        for n, p in params:
            p.copy_(init[n])
    return e


def train(engine, seeds) -> None:
    for s in seeds:
        b = make_batch(LENGTHS, seed=s)
        engine.train_batch(b, ppo_like_loss, advantages_for(b))


def weights(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.named_weights_for_transfer()}


def opt_tensors(view) -> dict[str, torch.Tensor]:
    """The optimizer's moments and step counts, by parameter index."""
    state = view.optimizer.state_dict()["state"]
    return {f"{i}.{k}": v.clone() for i, st in state.items() for k, v in st.items() if torch.is_tensor(v)}


def test_each_adapter_trains_like_its_own_engine(tiny_model_dir):
    m = multi_engine(tiny_model_dir)
    a, b = m.policy("A"), m.policy("b.v2")
    init = {"A": weights(a), "b.v2": weights(b)}
    base = {n: p.detach().clone() for n, p in m.model.named_parameters() if ".lora_" not in n}
    # Interleaved, as a trainer alternating policies would call it.
    for x, y in zip(X_SEEDS, Y_SEEDS):
        train(a, [x])
        train(b, [y])
    assert a.step == b.step == 3

    for lora, view, seeds, other in ((LORA_A, a, X_SEEDS, Y_SEEDS), (LORA_B, b, Y_SEEDS, X_SEEDS)):
        ref = single_engine(tiny_model_dir, lora, init[lora["name"]])
        train(ref, seeds)
        # Floor: the one-adapter engine again with another micro-batch split
        # (the same numbers summed in another order), 3 steps on.
        split = single_engine(tiny_model_dir, lora, init[lora["name"]], max_tokens_per_mb=40)
        train(split, seeds)
        floor = measure_noise_floor(
            f"{lora['name']} after 3 steps, other micro-batch split", weights(ref), weights(split)
        )
        print(assert_within_noise(weights(view), weights(ref), floor, MULTIPLE, what=f"{lora['name']} in one engine"))
        # Negative control: the same adapter trained on the other policy's batches is far outside.
        ctrl = single_engine(tiny_model_dir, lora, init[lora["name"]])
        train(ctrl, other)
        assert max_difference(weights(view), weights(ctrl)).value > MULTIPLE * floor.value
        assert view.adapter_spec().name == lora["name"]

    after = {n: p.detach() for n, p in m.model.named_parameters() if ".lora_" not in n}
    assert after.keys() == base.keys() and all(torch.equal(after[n], base[n]) for n in base)


def test_training_one_adapter_leaves_the_other_exactly(tiny_model_dir):
    m = multi_engine(tiny_model_dir)
    a, b = m.policy("A"), m.policy("b.v2")
    probe = make_batch(LENGTHS, seed=3)
    train(a, [10])  # A's lora_B is no longer zero: A scores unlike the base
    lp_a, lp_b = a.compute_logprobs(probe), b.compute_logprobs(probe)
    assert max_abs_diff(lp_a, lp_b) > 0.0
    opt_a = opt_tensors(a)
    assert opt_a

    train(b, [20, 21])
    assert max_abs_diff(a.compute_logprobs(probe), lp_a) == 0.0
    assert max_abs_diff(b.compute_logprobs(probe), lp_b) > 0.0
    opt_a2 = opt_tensors(a)
    assert opt_a2.keys() == opt_a.keys() and all(torch.equal(opt_a[k], opt_a2[k]) for k in opt_a)
    # Negative control: training A does change how A scores.
    train(a, [11])
    assert max_abs_diff(a.compute_logprobs(probe), lp_a) > 0.0


def test_the_base_with_adapters_off_is_every_policys_reference(tiny_model_dir):
    """``score_base``: the frozen base with every adapter off, a multi-policy
    run's reference for ``kl_coef``. It scores exactly as a plain engine on
    the same model, before and after both adapters trained (they no longer
    score like it), and as each policy did before its first step."""
    m = multi_engine(tiny_model_dir)
    a, b = m.policy("A"), m.policy("b.v2")
    probe = make_batch(LENGTHS, seed=3)
    plain = make_engine(tiny_model_dir, **COMMON).compute_logprobs(probe)
    assert max_abs_diff(m.score_base(probe), plain) == 0.0
    assert max_abs_diff(a.compute_logprobs(probe), plain) == 0.0  # an untrained adapter is a no-op
    train(a, [10])
    train(b, [20])
    assert max_abs_diff(m.score_base(probe), plain) == 0.0
    # Negative control: the trained policies moved away from it.
    assert max_abs_diff(a.compute_logprobs(probe), plain) > 0.0 and max_abs_diff(b.compute_logprobs(probe), plain) > 0.0
    # Scoring the base leaves the active adapter as it was.
    lp_a = a.compute_logprobs(probe)
    m.score_base(probe)
    assert max_abs_diff(a.compute_logprobs(probe), lp_a) == 0.0
    with pytest.raises(ConfigError, match="holds no adapters"):
        make_engine(tiny_model_dir, **COMMON).score_base(probe)


def test_per_adapter_export_and_weight_update(tiny_model_dir, tmp_path):
    from peft import PeftModel

    m = multi_engine(tiny_model_dir)
    a, b = m.policy("A"), m.policy("b.v2")
    train(a, X_SEEDS[:2])
    train(b, Y_SEEDS[:2])
    batch = make_batch(LENGTHS, seed=4)

    a.save_hf(str(tmp_path / "A"))
    files = set(os.listdir(tmp_path / "A"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "config.json" not in files
    cfg = json.loads((tmp_path / "A" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and sorted(cfg["target_modules"]) == ["q_proj", "up_proj", "v_proj"]

    def peft(attn: str):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn)
        return PeftModel.from_pretrained(base, tmp_path / "A")

    got = hf_logprobs(peft("sdpa"), batch)
    floor = measure_noise_floor("logprobs, same weights", got, hf_logprobs(peft("eager"), batch))
    print(assert_within_noise(got, a.compute_logprobs(batch), floor, MULTIPLE, what="A's adapter export vs engine"))

    # B exports merged: the base with B alone merged in.
    b.lora = b.lora.model_copy(update={"export": "merged"})
    b.save_hf(str(tmp_path / "B"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "B"))
    want_b = b.compute_logprobs(batch)
    print(assert_within_noise(hf_logprobs(merged, batch), want_b, floor, MULTIPLE, what="B's merged export"))
    # Negative control: B's merged model does not score like A.
    assert max_difference(hf_logprobs(merged, batch), a.compute_logprobs(batch)).value > MULTIPLE * floor.value

    # A disk weight update ships that adapter alone, exactly its live tensors.
    b.send_weights(WeightUpdateMeta(kind="disk", version=1, path=str(tmp_path / "upd")))
    assert set(os.listdir(tmp_path / "upd")) == {"adapter_config.json", "adapter_model.safetensors"}
    sent_cfg, sent = read_adapter_dir(str(tmp_path / "upd"))
    assert sent_cfg["r"] == 2
    live = weights(b)
    assert sent.keys() == live.keys() and all(torch.equal(sent[n], live[n]) for n in live)
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in live)
    assert all(t.shape[0] == 2 or t.shape[1] == 2 for t in live.values())  # rank 2: B's tensors only


def test_a_view_round_trips_its_state(tiny_model_dir, tmp_path):
    m = multi_engine(tiny_model_dir)
    train(m.policy("A"), [10])
    # The house pattern (rank engines use it too), run on one view of the engine.
    rt = state_round_trip(m.policy("A"), str(tmp_path / "ckpt"), make_ppo_loss_fn(eps_clip=0.2))
    rt.assert_continues_identically()


def test_engine_state_restores_every_adapter_and_optimizer(tiny_model_dir, tmp_path):
    # Dropout on the adapters' inputs draws from the engine's RNG: its checkpoint restores that too.
    adapters = [{**LORA_A, "dropout": 0.2}, {**LORA_B, "dropout": 0.1}]
    m = multi_engine(tiny_model_dir, adapters)
    a, b = m.policy("A"), m.policy("b.v2")
    train(a, [10])
    train(b, [20, 21])
    a.set_version(3)
    b.set_version(5)
    m.save_state(str(tmp_path / "ckpt"))

    saved = {v.name: (weights(v), opt_tensors(v), v.step) for v in (a, b)}
    probe = make_batch(LENGTHS, seed=3)

    def continue_(engine):
        train(engine.policy("A"), [11])
        train(engine.policy("b.v2"), [22])
        return engine.policy("A").compute_logprobs(probe), engine.policy("b.v2").compute_logprobs(probe)

    want = continue_(m)

    fresh = multi_engine(tiny_model_dir, adapters)
    fresh.load_state(str(tmp_path / "ckpt"))
    for name, (w, opt, step) in saved.items():
        v = fresh.policy(name)
        got_w, got_opt = weights(v), opt_tensors(v)
        assert got_w.keys() == w.keys() and all(torch.equal(got_w[n], w[n]) for n in w)
        assert got_opt.keys() == opt.keys() and all(torch.equal(got_opt[n], opt[n]) for n in opt)
        assert v.step == step
    assert (fresh.policy("A").get_version(), fresh.policy("b.v2").get_version()) == (3, 5)
    got = continue_(fresh)
    assert max_abs_diff(got[0], want[0]) == 0.0 and max_abs_diff(got[1], want[1]) == 0.0

    # Negative control: without the checkpoint the same continuation differs.
    ctrl = continue_(multi_engine(tiny_model_dir, adapters))
    assert max_abs_diff(ctrl[1], want[1]) > 0.0

    # A checkpoint of other policies, or of a one-adapter engine, does not load.
    other = make_engine(tiny_model_dir, adapters=[LORA_A], **COMMON)
    with pytest.raises(DataError, match=r"holds the policies \['A', 'b.v2'\]"):
        other.load_state(str(tmp_path / "ckpt"))
    one = make_engine(tiny_model_dir, lora=LORA_A, **COMMON)
    one.save_state(str(tmp_path / "one"))
    with pytest.raises(DataError, match="not a torch-adapters engine checkpoint"):
        fresh.load_state(str(tmp_path / "one"))


def test_bad_input(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"adapters: .*entries 0 and 1 are both named 'A'"):
        TorchEngineConfig.parse({"adapters": [LORA_A, {**LORA_B, "name": "A"}]})
    with pytest.raises(ConfigError, match="lora and adapters are both set"):
        TorchEngineConfig.parse({"lora": LORA_A, "adapters": [LORA_B]})
    with pytest.raises(ConfigError, match=r"adapters\.1\.name"):
        TorchEngineConfig.parse({"adapters": [LORA_A, {"name": "has space"}]})

    with pytest.raises(ConfigError) as err:
        make_engine(tiny_model_dir, adapters=[LORA_A, {**LORA_B, "target_modules": ["k_proj", "qq_proj"]}])
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(
        "actor.torch.adapters[1] (name 'b.v2').target_modules: no module of the model is named 'qq_proj'"
    )

    m = multi_engine(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"unknown policy 'C': this engine trains 'A', 'b.v2'"):
        m.policy("C")
    batch = make_batch(LENGTHS, seed=1)
    # The engine's own per-policy calls would not say which adapter: refused.
    for call in (lambda: m.compute_logprobs(batch), lambda: m.train_batch(batch, ppo_like_loss, advantages_for(batch)),
                 lambda: m.named_weights_for_transfer(), lambda: m.adapter_spec()):  # fmt: skip
        with pytest.raises(ConfigError, match=r"several adapters \(A, b.v2\).*engine\.policy\(name\)"):
            call()
    with pytest.raises(Exception, match="initialize the engine"):
        m.policy("A").initialize(tiny_model_dir, 4)


def test_one_policy_engines_are_their_own_policy(tiny_model_dir):
    full = make_engine(tiny_model_dir)
    assert full.policy_names() == ["policy"] and full.policy("policy") is full
    lora = make_engine(tiny_model_dir, lora=LORA_A)
    assert lora.policy("A") is lora
    with pytest.raises(ConfigError, match="unknown policy 'policy'"):
        lora.policy("policy")
