"""``policies:`` (several policies in one run, docs/multi-policy.md): how a
policy's config is built from the run's, and the one-line errors that come
before anything starts. The runs themselves: tests/e2e/test_multi_policy.py."""

from __future__ import annotations

import pytest

from areal_kernel.config import load_config
from areal_kernel.config.loader import check_policies
from areal_kernel.config.policies import adapter_settings, policy_config_data, served_adapters
from areal_kernel.errors import ConfigError
from areal_kernel.plugins import get_registry

TWO = (
    "policies={add: {lora: {rank: 4, alpha: 8}}, "
    "sub: {lora: {rank: 8}, dataset: {arithmetic: {ops: ['-']}}, batch_size: 3, max_staleness: 0, weight: 2}}"
)


def _load(tmp_path, *overrides: str, text: str = "trainer: {batch_size: 5}\n"):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(str(path), list(overrides), get_registry())


def test_each_policy_is_the_runs_config_with_its_own_sections(tmp_path):
    cfg = _load(tmp_path, TWO, "dataset.arithmetic.n_train=300")
    configs = check_policies(cfg, get_registry())
    assert list(configs) == ["add", "sub"]
    add, sub = configs["add"], configs["sub"]
    # No section of its own: the run's, whole.
    assert add.dataset.plugin_config.ops == cfg.dataset.plugin_config.ops
    assert add.trainer.batch_size == 5 and add.rollout.max_staleness == cfg.rollout.max_staleness
    # A section of the same type is merged over the run's (n_train kept).
    assert sub.dataset.plugin_config.ops == ["-"] and sub.dataset.plugin_config.n_train == 300
    assert sub.trainer.batch_size == 3 and sub.rollout.max_staleness == 0
    assert not add.policies and not sub.policies
    # A section naming another type replaces the run's.
    cfg = _load(tmp_path, "policies={a: {reward: {type: char_share, char_share: {chars: xyz}}}}")
    data = policy_config_data(cfg, "a")
    assert data["reward"] == {"type": "char_share", "char_share": {"chars": "xyz"}}
    assert check_policies(cfg, get_registry())["a"].reward.plugin_config.chars == "xyz"
    # The engine gets one adapter per policy, named after it.
    settings = adapter_settings(_load(tmp_path, TWO))
    assert [(a.name, a.rank, a.alpha) for a in settings.adapters] == [("add", 4, 8), ("sub", 8, 16)]


def test_the_servers_serve_every_policys_adapter_also_from_one_policys_config(tmp_path):
    """What an inference backend sizes its adapter slots from: every policy's
    adapter (largest rank, every targeted module), also from the config of
    the policy whose config starts the servers; the actor's lora in a
    one-policy run; nothing for a full-model run."""
    two = "policies={add: {lora: {rank: 4, alpha: 8}}, sub: {lora: {rank: 8, target_modules: [q_proj, up_proj]}}}"
    cfg = _load(tmp_path, two)
    served = served_adapters(cfg)
    assert served is not None and served.names == ("add", "sub") and served.max_rank == 8
    assert served.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj")
    assert served_adapters(check_policies(cfg, get_registry())["add"]) == served
    one = served_adapters(_load(tmp_path, "actor.torch.lora={rank: 16, name: mine}"))
    assert one is not None and (one.names, one.max_rank) == (("mine",), 16)
    assert served_adapters(_load(tmp_path)) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["policies={a: {weight: 0}}"], "policies.a.weight: Input should be greater than 0"),
        (["policies={a: {lora: {name: x}}}"], "policies.a.lora.name: the adapter is named after its policy"),
        (["policies={a: {lora: {rank: 0}}}"], "policies.a.lora.rank: Input should be greater than or equal to 1"),
        (["policies={a: {dataset: {arithmetic: {op: x}}}}"], "policies.a: dataset.arithmetic.op: unknown key"),
        (["policies={a: {batch_size: 0}}"], "policies.a.batch_size: Input should be greater than or equal to 1"),
        (["policies={a: {algorithm: {kl_coef: -1}}}"], "algorithm.kl_coef: Input should be greater than or equal to 0"),
        (["policies={'a/b': {}}"], "policy name 'a/b'"),
        (["policies={a: {}}", "actor.torch.lora={rank: 4}"], "drop actor.torch.lora"),
        (["policies={a: {}}", "actor.backend=megatron"], "actor.backend 'megatron' does not hold one adapter per policy"),
        (["policies={a: {}}", "actor.backend=megatron"], "train engines that do: fsdp, torch"),
        (["policies={a: {}}", "algorithm.type=sft", "dataset.type=file", "dataset.path=x.jsonl"],
         "algorithm.type 'sft' trains one policy"),
    ],
)  # fmt: skip
def test_bad_policies_are_one_line_naming_the_policy_and_field(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, *overrides)
    assert message in str(e.value), str(e.value)
    assert "Traceback" not in str(e.value)


def test_together_needs_an_engine_with_the_joint_step(tmp_path):
    """``trainer.policy_order: together`` loads with the engines that declare
    ``joint_policies`` (torch, fsdp); an engine holding one adapter per
    policy without it (as a third-party engine may; here fsdp's
    registration less that capability) gets one line naming the field, the
    backend and the engines that can."""
    import dataclasses

    from areal_kernel.plugins.registry import Registry

    together = ("policies={a: {}, b: {}}", "trainer.policy_order=together")
    for backend in ("torch", "fsdp"):
        assert set(check_policies(_load(tmp_path, *together, f"actor.backend={backend}"), get_registry())) == {"a", "b"}
    cfg = _load(tmp_path, *together, "actor.backend=fsdp")
    registry = Registry()
    for spec in get_registry().specs():
        if (spec.kind, spec.name) == ("train_engine", "fsdp"):
            spec = dataclasses.replace(spec, capabilities=spec.capabilities - {"joint_policies"})
        registry.add(spec)
    with pytest.raises(ConfigError) as e:
        check_policies(cfg, registry)
    message = str(e.value)
    assert "trainer.policy_order: together: actor.backend 'fsdp' cannot step several policies" in message
    assert message.endswith("a train engine that can: torch") and "\n" not in message, message


def test_a_policy_name_written_twice_is_refused_by_the_loader(tmp_path):
    text = "policies:\n  add:\n    weight: 1\n  add:\n    weight: 2\n"
    with pytest.raises(ConfigError, match=r"c.yaml:4:3: invalid YAML: duplicate key 'add' \(first written at line 2\)"):
        _load(tmp_path, text=text)


def test_one_policy_run_has_no_policies_and_the_engines_adapters_point_at_policies(tmp_path):
    assert check_policies(_load(tmp_path), get_registry()) == {}
    from areal_kernel.trainer.multi_policy import GRPOTrainer, MultiPolicyTrainer
    from areal_kernel.api.trainer import TrainerContext
    from areal_kernel.trainer.run import RLTrainer

    assert type(GRPOTrainer(TrainerContext.for_config(_load(tmp_path))).impl) is RLTrainer
    assert type(GRPOTrainer(TrainerContext.for_config(_load(tmp_path, TWO))).impl) is MultiPolicyTrainer


def test_together_groups_follow_the_weights():
    """``trainer.policy_order: together``: each step, the policy furthest
    behind its share and every policy that would not get ahead of it. Equal
    weights: all at every step; weights 2 and 1: the first at every step,
    the second at every other one; a finished policy leaves the groups."""
    from types import SimpleNamespace

    from areal_kernel.trainer.multi_policy import MultiPolicyTrainer, Policy

    def run(weights: dict[str, float], steps: dict[str, int]) -> list[str]:
        ps = [Policy(name=n, cfg=None, ctx=None, weight=w, train_records=[], eval_records=[], total_steps=steps[n])  # type: ignore[arg-type]
              for n, w in weights.items()]  # fmt: skip
        order = []
        while todo := [p for p in ps if p.steps < p.total_steps]:
            group = MultiPolicyTrainer._together_group(SimpleNamespace(), todo)  # type: ignore[arg-type]
            order.append("".join(p.name for p in group))
            for p in group:
                p.steps += 1
        return order

    assert run({"a": 1, "b": 1}, {"a": 3, "b": 3}) == ["ab", "ab", "ab"]
    assert run({"a": 2, "b": 1}, {"a": 4, "b": 2}) == ["ab", "a", "ab", "a"]
    assert run({"a": 1, "b": 2}, {"a": 2, "b": 4}) == ["ab", "b", "ab", "b"]  # ties: the order written
    assert run({"a": 1, "b": 1}, {"a": 1, "b": 3}) == ["ab", "b", "b"]
