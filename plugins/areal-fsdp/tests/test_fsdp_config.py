"""``actor.fsdp`` validation, allocation handling and the light entry point (no ranks started)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from areal_kernel.errors import ConfigError


def _cfg(actor: dict):
    from areal_kernel.config.models import ExperimentConfig
    from areal_kernel.plugins import get_registry
    from areal_kernel.config import resolve

    return resolve(ExperimentConfig.model_validate({"actor": actor}), get_registry())


def test_fsdp_section_is_validated_by_the_plugin_model():
    from areal_fsdp.config import FSDPEngineConfig

    cfg = _cfg({"backend": "fsdp:d2", "fsdp": {"lr": 1e-5, "reshard_after_forward": False,
                                               "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                                               "wrap_policy": "root", "gradient_checkpointing": True}})  # fmt: skip
    assert cfg.actor.allocation.world_size == 2
    pc = cfg.actor.plugin_config
    assert isinstance(pc, FSDPEngineConfig)
    assert pc.mixed_precision.param_dtype == "bfloat16" and pc.wrap_policy == "root" and not pc.reshard_after_forward


@pytest.mark.parametrize(
    "section, needle",
    [
        ({"reshard": True}, "actor.fsdp.reshard: unknown key"),
        ({"mixed_precision": {"param_dtype": "fp8"}}, "actor.fsdp.mixed_precision.param_dtype"),
        ({"wrap_policy": "layers"}, "actor.fsdp.wrap_policy"),
        ({"max_tokens_per_mb": 0}, "actor.fsdp.max_tokens_per_mb"),
    ],
)
def test_bad_settings_name_the_field(section, needle):
    with pytest.raises(ConfigError) as e:
        _cfg({"backend": "fsdp:d2", "fsdp": section})
    assert needle in str(e.value)


def test_torch_settings_under_fsdp_backend_point_to_the_right_section():
    with pytest.raises(ConfigError, match="go under actor.fsdp"):
        _cfg({"backend": "fsdp:d2", "torch": {"lr": 1e-5}})


@pytest.mark.parametrize(
    "alloc, others",
    [("fsdp:t2c2", "t2"), ("fsdp:d2c2e2", "e2"), ("fsdp:p2c2", "p2"), ("fsdp:d2t2c2", "t2")],
)
def test_context_with_other_model_dims_is_refused(alloc, others):
    """One line naming the allocation, the dims it cannot combine and what is
    valid: from the engine and from `areal validate` (the kernel's check)."""
    from areal_fsdp.engine import FSDPTrainEngine

    line = rf"{alloc} combines context parallelism \(c2\) with {others}, .*valid: c with data parallelism only"
    with pytest.raises(ConfigError, match=line):
        FSDPTrainEngine({}, allocation=alloc)
    with pytest.raises(ConfigError, match=rf"actor.backend: {line}"):
        _cfg({"backend": alloc})


def test_context_layout():
    """fsdp:c2 and fsdp:d2c2: d*c ranks, data-major (the context ranks of a
    replica are neighbours), coordinates (d, c), the part per replica."""
    from areal_fsdp.engine import FSDPTrainEngine

    c2 = FSDPTrainEngine({}, allocation="fsdp:c2")
    assert (c2.world_size, c2.data_parallel_size, str(c2.layout), str(c2.allocation)) == (2, 1, "fsdp:d1c2", "fsdp:c2")
    assert c2.create_kwargs()["cp"] == 2 and FSDPTrainEngine({}, allocation="fsdp:d2").create_kwargs()["cp"] == 1
    d2c2 = FSDPTrainEngine({}, allocation="fsdp:d2c2")
    assert (d2c2.world_size, d2c2.data_parallel_size, str(d2c2.layout)) == (4, 2, "fsdp:d2c2")
    assert [d2c2.layout.rank_coords(r) for r in range(4)] == [
        {"d": 0, "c": 0}, {"d": 0, "c": 1}, {"d": 1, "c": 0}, {"d": 1, "c": 1},
    ]  # fmt: skip
    assert _cfg({"backend": "fsdp:d2c2"}).actor.allocation.world_size == 4


def test_expert_layout():
    """fsdp:d2e2: 2 ranks (the kernel counts d*t*p*c; experts reuse them), coordinates (d, e)."""
    from areal_fsdp.engine import FSDPTrainEngine

    e2 = FSDPTrainEngine({}, allocation="fsdp:d2e2")
    assert (e2.world_size, e2.data_parallel_size, str(e2.layout)) == (2, 2, "fsdp:d2e2")
    assert str(e2.allocation) == "fsdp:d2e2"
    assert [e2.layout.rank_coords(r) for r in range(2)] == [{"d": 0, "e": 0}, {"d": 1, "e": 1}]
    assert e2.create_kwargs()["ep"] == 2 and FSDPTrainEngine({}, allocation="fsdp:d2").create_kwargs()["ep"] == 1
    assert _cfg({"backend": "fsdp:d4e4"}).actor.allocation.world_size == 4


@pytest.mark.parametrize(
    "alloc, line",
    [
        ("fsdp:e2", r"fsdp:e2 is one rank: .* reuses them, .* write 'fsdp:d2e2' \(2 ranks, each holding 1/2"),
        ("fsdp:d4e2", r"fsdp:d4e2: the fsdp engine splits the experts over all data ranks \(e = d\).*'fsdp:d4e4'"),
        ("fsdp:d2t2e2", r"fsdp:d2t2e2 combines expert parallelism \(e2\) with t2, .*e.g. 'fsdp:d2e2'"),
        ("fsdp:p2e2", r"fsdp:p2e2 combines expert parallelism \(e2\) with p2"),
    ],
)
def test_expert_forms_this_engine_does_not_run_are_refused(alloc, line):
    """One line each, from the engine and from `areal validate`."""
    from areal_fsdp.engine import FSDPTrainEngine

    with pytest.raises(ConfigError, match=line):
        FSDPTrainEngine({}, allocation=alloc)
    with pytest.raises(ConfigError, match=rf"actor.backend: {line}"):
        _cfg({"backend": alloc})


# Settings the expert-, pipeline- and context-parallel layouts refuse (data parallelism alone keeps them;
# tensor parallelism keeps LoRA without dropout).
SPLIT_UNSUPPORTED = [
    ({"lora": {"rank": 4}}, "lora"),
    ({"gradient_checkpointing": True}, "gradient_checkpointing"),
    ({"cpu_offload": True}, "cpu_offload"),
    ({"autocast_bf16": True}, "autocast_bf16"),
    ({"mixed_precision": {"param_dtype": "bfloat16"}}, "mixed_precision"),
]


@pytest.mark.parametrize("section, field", SPLIT_UNSUPPORTED)
def test_settings_expert_parallelism_does_not_support_are_refused(section, field):
    from areal_fsdp.engine import FSDPTrainEngine

    with pytest.raises(ConfigError, match=rf"fsdp:d2e2 \(e2\) with actor.fsdp.{field} is not supported"):
        FSDPTrainEngine(section, allocation="fsdp:d2e2")


def test_models_expert_parallelism_cannot_split_are_refused():
    from types import SimpleNamespace

    from areal_fsdp.expert_parallel import check_ep_model

    moe = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2)
    check_ep_model(SimpleNamespace(**moe), 2, "fsdp:d2e2")
    check_ep_model(SimpleNamespace(model_type="llama"), 1, "fsdp:d2")  # e1: nothing to split
    with pytest.raises(ConfigError, match=r"actor.backend: fsdp:d2e2 asks for expert parallelism \(e2\), but the "
                       r"model \('llama'\) is not a mixture-of-experts model .*'fsdp:d2'"):  # fmt: skip
        check_ep_model(SimpleNamespace(model_type="llama"), 2, "fsdp:d2e2")
    with pytest.raises(ConfigError, match=r"fsdp:d4e4: the model's num_experts=6 does not divide by e=4"):
        check_ep_model(SimpleNamespace(**{**moe, "num_experts": 6}), 4, "fsdp:d4e4")
    with pytest.raises(ConfigError, match=r"fsdp:d2e2: .*experts of model types qwen3_moe, not 'mixtral'"):
        check_ep_model(SimpleNamespace(model_type="mixtral", num_local_experts=8), 2, "fsdp:d2e2")


def test_a_dense_model_is_refused_before_any_rank_starts(tmp_path):
    """The controller reads config.json first: a dense Llama with fsdp:d2e2
    is one line naming actor.backend, and no rank was started."""
    import json

    from areal_fsdp.engine import FSDPTrainEngine

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    e = FSDPTrainEngine({}, allocation="fsdp:d2e2")
    with pytest.raises(ConfigError, match=r"actor.backend: fsdp:d2e2 asks for expert parallelism \(e2\), but the "
                       r"model \('llama'\) is not a mixture-of-experts model"):  # fmt: skip
        e.initialize(str(tmp_path), 10)
    assert e.ranks is None


def test_a_sliding_window_model_is_refused_by_context_parallelism_before_any_rank_starts(tmp_path):
    """The controller reads config.json first: a model with sliding-window
    attention and fsdp:c2 is one line naming the layout, and no rank was started."""
    import json

    from areal_fsdp.engine import FSDPTrainEngine

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "sliding_window": 4096}))
    e = FSDPTrainEngine({}, allocation="fsdp:c2")
    with pytest.raises(ConfigError, match=r"actor.backend: fsdp:d1c2 \(c2\): the model \('mistral'\) uses "
                       r"sliding-window attention, which the context-parallel attention does not compute"):  # fmt: skip
        e.initialize(str(tmp_path), 10)
    assert e.ranks is None


@pytest.mark.parametrize("alloc, others", [("fsdp:d2p2", "d2"), ("fsdp:t2p2", "t2"), ("fsdp:d2t2p2", "d2t2")])
def test_pipeline_with_other_dims_is_refused(alloc, others):
    """p runs alone for now: one line naming the allocation, what it combines
    and what is valid, from the engine and from `areal validate`."""
    from areal_fsdp.engine import FSDPTrainEngine

    line = rf"actor.backend: {alloc} combines pipeline parallelism \(p2\) with {others}, .*valid: p alone \('fsdp:p2'\)"
    with pytest.raises(ConfigError, match=line):
        FSDPTrainEngine({}, allocation=alloc)
    with pytest.raises(ConfigError, match=line):
        _cfg({"backend": alloc})


def test_pipeline_layout_and_schedule_setting():
    from areal_fsdp.engine import FSDPTrainEngine
    from areal_fsdp.layout import split_layers, stage_rank

    p2 = FSDPTrainEngine({}, allocation="fsdp:p2")
    assert (p2.world_size, p2.data_parallel_size, str(p2.layout), str(p2.allocation)) == (2, 1, "fsdp:d1p2", "fsdp:p2")
    assert [p2.layout.rank_coords(r) for r in range(2)] == [{"d": 0, "p": 0}, {"d": 0, "p": 1}]
    assert p2.create_kwargs()["pp"] == 2 and p2.config.pipeline_schedule == "1f1b"
    assert _cfg({"backend": "fsdp:p4"}).actor.allocation.world_size == 4
    # Layers by count, the earlier stages taking the remainder; stages round-robin over the ranks.
    assert split_layers(30, 2) == [range(0, 15), range(15, 30)]
    assert split_layers(5, 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    with pytest.raises(ValueError, match="3 decoder layers cannot fill 4 pipeline stages"):
        split_layers(3, 4)
    assert [stage_rank(s, 2) for s in range(4)] == [0, 1, 0, 1]
    cfg = _cfg({"backend": "fsdp:p2", "fsdp": {"pipeline_schedule": "interleaved_1f1b"}})
    assert cfg.actor.plugin_config.pipeline_schedule == "interleaved_1f1b"
    with pytest.raises(ConfigError) as e:
        _cfg({"backend": "fsdp:p2", "fsdp": {"pipeline_schedule": "zero_bubble"}})
    assert "actor.fsdp.pipeline_schedule" in str(e.value) and "'1f1b'" in str(e.value)
    print(e.value)


@pytest.mark.parametrize("section, field", SPLIT_UNSUPPORTED)
def test_settings_context_parallelism_does_not_support_are_refused(section, field):
    from areal_fsdp.engine import FSDPTrainEngine

    with pytest.raises(ConfigError, match=rf"fsdp:d1c2 \(c2\) with actor.fsdp.{field} is not supported"):
        FSDPTrainEngine(section, allocation="fsdp:c2")


@pytest.mark.parametrize("section, field", SPLIT_UNSUPPORTED)
def test_settings_pipeline_parallelism_does_not_support_are_refused(section, field):
    from areal_fsdp.engine import FSDPTrainEngine

    with pytest.raises(ConfigError, match=rf"fsdp:d1p2 \(p2\) with actor.fsdp.{field} is not supported"):
        FSDPTrainEngine(section, allocation="fsdp:p2")
    FSDPTrainEngine(section, allocation="fsdp:d2")  # data parallelism alone keeps them


def test_data_and_tensor_dims_are_accepted():
    from areal_fsdp.engine import FSDPTrainEngine

    assert FSDPTrainEngine({}, world_size=3).world_size == 3
    assert FSDPTrainEngine({}, allocation="fsdp:d4").world_size == 4
    t2 = FSDPTrainEngine({}, allocation="fsdp:t2")
    assert (t2.world_size, t2.data_parallel_size, str(t2.layout)) == (2, 1, "fsdp:d1t2")
    d2t2 = FSDPTrainEngine({}, allocation="fsdp:d2t2")
    assert (d2t2.world_size, d2t2.data_parallel_size) == (4, 2)
    # Data-major rank numbering: the tensor ranks of one replica are neighbours.
    assert [d2t2.layout.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert _cfg({"backend": "fsdp:d2t2"}).actor.allocation.world_size == 4


@pytest.mark.parametrize(
    "section, field",
    [
        ({"lora": {"rank": 4, "dropout": 0.1}}, "lora.dropout=0.1"),
        ({"gradient_checkpointing": True}, "gradient_checkpointing"),
        ({"cpu_offload": True}, "cpu_offload"),
    ],
)
def test_settings_tensor_parallelism_does_not_support_are_refused(section, field):
    from areal_fsdp.engine import FSDPTrainEngine

    with pytest.raises(ConfigError, match=rf"fsdp:d1t2 \(t2\) with actor.fsdp.{field} is not supported"):
        FSDPTrainEngine(section, allocation="fsdp:t2")
    FSDPTrainEngine(section, allocation="fsdp:d2")  # data parallelism alone keeps them


def test_lora_without_dropout_is_accepted_with_tensor_parallelism():
    """The adapters are split with their base layers (tensor_parallel.module_plan)."""
    from areal_fsdp.engine import FSDPTrainEngine

    for alloc in ("fsdp:t2", "fsdp:d2t2"):
        FSDPTrainEngine({"lora": {"rank": 4}}, allocation=alloc)


def test_models_tensor_parallelism_cannot_split_are_refused():
    from types import SimpleNamespace

    from areal_fsdp.tensor_parallel import check_tp_model

    llama = dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    check_tp_model(SimpleNamespace(**llama), 2, "fsdp:t2")
    check_tp_model(SimpleNamespace(**{**llama, "num_key_value_heads": 1}), 1, "fsdp:d2")  # t1: nothing to split
    with pytest.raises(ConfigError, match=r"fsdp:t2: the model's num_key_value_heads=1 do not divide by t=2"):
        check_tp_model(SimpleNamespace(**{**llama, "num_key_value_heads": 1}), 2, "fsdp:t2")
    with pytest.raises(ConfigError, match=r"fsdp:t4: .*num_attention_heads=6, num_key_value_heads=6"):
        check_tp_model(SimpleNamespace(**{**llama, "num_attention_heads": 6, "num_key_value_heads": 6}), 4, "fsdp:t4")
    with pytest.raises(ConfigError, match=r"fsdp:t2: .*plan for model types llama, qwen3, qwen2, not 'gpt2'"):
        check_tp_model(SimpleNamespace(**{**llama, "model_type": "gpt2"}), 2, "fsdp:t2")


def test_engine_is_built_from_the_kernel_context(tmp_path):
    """The kernel's factory call: rank count from the allocation, settings
    from the validated section, logs under the run directory, the run's
    scheduler used (never stopped by the engine)."""
    from areal_fsdp.engine import FSDPTrainEngine

    from areal_kernel.api.engine import TrainEngineContext
    from areal_kernel.platforms import current_platform
    from areal_kernel.scheduling.local import LocalScheduler

    cfg = _cfg({"backend": "fsdp:d3", "fsdp": {"lr": 0.5}})
    sched = LocalScheduler(cfg)
    ctx = TrainEngineContext(settings=cfg.actor.plugin_config, config=cfg, allocation=cfg.actor.allocation,
                             platform=current_platform(), run_dir=str(tmp_path), scheduler=sched)  # fmt: skip
    e = FSDPTrainEngine.from_context(ctx)
    assert e.world_size == 3 and e.config.lr == 0.5
    assert e.log_dir == str(tmp_path / "fsdp-ranks")
    assert e.rank_scheduler() is sched and not e.owns_scheduler
    ref = FSDPTrainEngine.from_context(dataclasses.replace(ctx, role="ref"))
    assert ref.log_dir == str(tmp_path / "fsdp-ranks-ref")


def test_kernel_builds_the_registered_engine_through_from_context(tmp_path):
    from areal_fsdp.engine import FSDPTrainEngine

    from areal_kernel.trainer.components import build_train_engine

    cfg = _cfg({"backend": "fsdp:d2", "fsdp": {"lr": 0.25}})
    e = build_train_engine(cfg, str(tmp_path))
    assert isinstance(e, FSDPTrainEngine) and e.world_size == 2 and e.config.lr == 0.25
    assert e.run_config is cfg and e.log_dir == str(tmp_path / "fsdp-ranks")


def test_entry_point_module_is_light():
    code = "import sys, areal_fsdp.plugin, areal_fsdp.config; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_registered_under_fsdp():
    from areal_kernel.plugins import get_registry

    spec = get_registry().get("train_engine", "fsdp")
    assert spec.target == "areal_fsdp.engine:FSDPTrainEngine" and "broadcast_export" in spec.capabilities


def test_local_scheduler_plans_one_process_per_rank():
    from areal_kernel.scheduling.local import LocalScheduler

    assert LocalScheduler(_cfg({"backend": "fsdp:d2"})).device_plan()["actor"] == [[], []]
    # A tensor rank is a process too: d2t2 is 4.
    assert LocalScheduler(_cfg({"backend": "fsdp:d2t2"})).device_plan()["actor"] == [[], [], [], []]
    # So is a pipeline rank: p2 is 2 (their (d, p) coordinates are the engine's, logged when it is ready).
    assert LocalScheduler(_cfg({"backend": "fsdp:p2"})).device_plan()["actor"] == [[], []]
    # Experts reuse the data ranks: d2e2 is 2.
    assert LocalScheduler(_cfg({"backend": "fsdp:d2e2"})).device_plan()["actor"] == [[], []]
    # A context rank is a process: d2c2 is 4.
    assert LocalScheduler(_cfg({"backend": "fsdp:d2c2"})).device_plan()["actor"] == [[], [], [], []]


def test_areal_plan_shows_every_ranks_mesh_coordinates():
    """`areal plan` (``make_plan``) gives each actor placement its mesh
    coordinates from ``FSDPTrainEngine.mesh_coords``: the rank order the
    engine builds its mesh in (t fastest, then d)."""
    from areal_kernel.config.loader import validate_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.scheduling.plan import make_plan

    cfg = validate_config({"actor": {"backend": "fsdp:d2t2"}}, registry=get_registry())
    plan = make_plan(cfg)
    want = [{"d": 0, "t": 0}, {"d": 0, "t": 1}, {"d": 1, "t": 0}, {"d": 1, "t": 1}]
    assert plan["roles"][0]["mesh"] == want
    assert [p["mesh"] for p in plan["placement"]["roles"]["actor"]] == want
    ep = make_plan(validate_config({"actor": {"backend": "fsdp:d2e2"}}, registry=get_registry()))
    assert ep["roles"][0]["mesh"] == [{"d": 0, "e": 0}, {"d": 1, "e": 1}]
    cp = make_plan(validate_config({"actor": {"backend": "fsdp:c2"}}, registry=get_registry()))
    assert cp["roles"][0]["mesh"] == [{"d": 0, "c": 0}, {"d": 0, "c": 1}]
