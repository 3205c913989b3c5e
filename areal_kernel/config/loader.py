"""Load a YAML config, apply overrides, validate: one clear error on failure."""

from __future__ import annotations

import os
from typing import Any

import yaml
from pydantic import ValidationError

from areal_kernel.config.models import ExperimentConfig
from areal_kernel.config.overrides import apply_overrides
from areal_kernel.config.policies import ServedAdapters, adapter_settings, policy_config_data
from areal_kernel.config.resolve import PluginLookup, resolve
from areal_kernel.config.sections import format_validation_error
from areal_kernel.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key written twice in one mapping:
    plain YAML loading keeps the last one silently, so a section or a
    setting repeated by mistake (two ``rollout:`` blocks, a policy name
    used twice) would drop what the user wrote first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class says so
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first written at line {first.line + 1}); each key may appear once "
                    "in a mapping",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise ConfigError(f"{path}: config file not found")
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a directory; expected a YAML file")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def validate_config(
    data: dict[str, Any], source: str = "config", registry: PluginLookup | None = None
) -> ExperimentConfig:
    """``data`` (a YAML mapping) as a config, or one ``ConfigError`` saying
    what is wrong. With ``registry`` (``get_registry()``) the config is also
    resolved: plugin names checked and plugin settings validated (see
    ``resolve``); without, only its shape is checked, and reading a plugin's
    settings from it raises until it is resolved."""
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source} is invalid:\n" + format_validation_error(e, model=ExperimentConfig)) from None
    if registry is None:
        return config
    resolve(config, registry, source)
    if config.policies:
        check_policies(config, registry)
    check_elastic(config)
    return config


def check_elastic(cfg: ExperimentConfig) -> None:
    """``rollout.elastic`` against the rest of the (resolved) config: the
    starting fleet lies in ``[min, max]``; several policies (each adapter with
    its own versions) keep a fixed fleet for now."""
    elastic = cfg.rollout.elastic
    if elastic is None:
        return
    d = cfg.rollout.allocation.d
    if not elastic.min <= d <= elastic.max:
        raise ConfigError(
            f"rollout.elastic: the run starts with {d} server(s) (rollout.backend={cfg.rollout.backend!r}), "
            f"outside [min={elastic.min}, max={elastic.max}]; set rollout.backend's replica count within that range"
        )
    if cfg.policies:
        raise ConfigError(
            "rollout.elastic: a run with several policies (policies:) keeps a fixed fleet; remove rollout.elastic"
        )


def load_config(
    path: str | None, overrides: list[str] | None = None, registry: PluginLookup | None = None
) -> ExperimentConfig:
    """YAML file (or defaults when ``path`` is None) + overrides -> validated
    config, resolved against ``registry`` when one is given (see ``validate_config``)."""
    data = read_yaml(path) if path else {}
    if path:
        from areal_kernel.example_configs import resolve_shipped_refs

        data = resolve_shipped_refs(path, data)  # a shipped example's data, from any directory
    data = apply_overrides(data, list(overrides or []))
    return validate_config(data, source=path or "config", registry=registry)


def json_schema(registry: PluginLookup) -> dict[str, Any]:
    """JSON schema of the config, with each plugin section that ``registry``
    (``get_registry()``) holds a settings model for."""
    schema = ExperimentConfig.model_json_schema()
    defs = schema.setdefault("$defs", {})
    # Sections holding settings named after a registered factory: the plugin
    # sections, plus algorithm (estimators, losses) and logging (metric sinks).
    sections: list[tuple[str, tuple[str, ...]]] = [(c.__name__, (c.registry_kind,)) for c in _plugin_section_classes()]
    sections += [
        ("AlgorithmConfig", ("advantage_estimator", "loss", "trainer")),
        ("LoggingConfig", ("metric_sink",)),
        ("SchedulerConfig", ("scheduler",)),
    ]
    for section_name, kinds in sections:
        if section_name not in defs:
            continue
        props = defs[section_name].setdefault("properties", {})
        for spec in (s for kind in kinds for s in registry.specs(kind)):
            sub = _settings_schema(spec, defs, registry)
            # A trainer may read a shared section (settings_section: ipo reads algorithm.dpo).
            key = getattr(spec, "settings_section", None) or spec.name
            if sub is None:
                continue
            if key not in props:
                props[key] = sub
            elif key != spec.name:
                shared = props[key]
                shared["description"] = f"{shared.get('description', '')} Also read by {spec.kind} '{spec.name}'."
        defs[section_name]["additionalProperties"] = False
    return schema


# Fields of a settings model that hold settings per registered name of
# another kind (``workflow.multi_turn.tool_settings.<tool>: {...}``),
# validated against that kind's config models like a section of their own.
_NESTED_SETTINGS = {"tool_settings": "tool"}


def _settings_schema(spec: Any, defs: dict[str, Any], registry: PluginLookup) -> dict[str, Any] | None:
    """The JSON schema of ``spec``'s config model (its definitions merged into
    ``defs``), or None for a factory without settings; nested per-name
    settings (``tool_settings``) list the factories ``registry`` holds."""
    model_cls = spec.config_model_cls()
    if model_cls is None:
        return None
    sub: dict[str, Any] = model_cls.model_json_schema()
    for k, v in sub.pop("$defs", {}).items():
        defs.setdefault(k, v)
    sub["description"] = f"Settings of {spec.kind} '{spec.name}' (plugin '{spec.plugin}')."
    for field, kind in _NESTED_SETTINGS.items():
        if field not in sub.get("properties", {}):
            continue
        per_name: dict[str, Any] = {}
        for inner in registry.specs(kind):
            # A factory without a config model takes no settings: only {} validates.
            per_name[inner.name] = _settings_schema(inner, defs, registry) or {
                "type": "object",
                "maxProperties": 0,
                "description": f"{kind} '{inner.name}' (plugin '{inner.plugin}') takes no settings.",
            }
        description = sub["properties"][field].get("description", "")
        sub["properties"][field] = {
            "type": "object",
            "properties": per_name,
            "additionalProperties": False,
            "description": description,
        }
    return sub


def _plugin_section_classes():
    from areal_kernel.config import models

    return [models.ActorConfig, models.RolloutConfig, models.DatasetConfig, models.WorkflowConfig, models.RewardConfig]


def check_policies(cfg: ExperimentConfig, registry: PluginLookup) -> dict[str, ExperimentConfig]:
    """Every policy's config, validated and resolved (``policies.<name>``
    heads its errors), after the adapters' engine settings; ``{}`` for a
    one-policy run."""
    if not cfg.policies:
        return {}
    trainer = registry.get("trainer", cfg.algorithm.type)
    if "policies" not in trainer.capabilities:
        able = sorted(s.name for s in registry.specs("trainer") if "policies" in s.capabilities)
        raise ConfigError(
            f"policies: algorithm.type {cfg.algorithm.type!r} trains one policy; trainers that train several "
            f"(capability 'policies'): {', '.join(able) or 'none installed'}"
        )
    backend = cfg.actor.allocation.backend
    engine = registry.get("train_engine", backend)
    if "policies" not in engine.capabilities:
        able = sorted(s.name for s in registry.specs("train_engine") if "policies" in s.capabilities)
        raise ConfigError(
            f"policies: actor.backend {backend!r} does not hold one adapter per policy (capability 'policies'); "
            f"train engines that do: {', '.join(able) or 'none installed'}"
        )
    if cfg.trainer.policy_order == "together" and "joint_policies" not in engine.capabilities:
        able = sorted(s.name for s in registry.specs("train_engine") if "joint_policies" in s.capabilities)
        raise ConfigError(
            f"trainer.policy_order: together: actor.backend {backend!r} cannot step several policies in one pass "
            f"over the base (capability 'joint_policies'); use weight or ready, or a train engine that can: "
            f"{', '.join(able) or 'none installed'}"
        )
    served = ServedAdapters.of(list(adapter_settings(cfg).adapters))
    out = {}
    for name in cfg.policies:
        try:
            pcfg = validate_config(policy_config_data(cfg, name), source=f"policies.{name}", registry=registry)
        except ConfigError as e:
            text = str(e)
            # Errors of plugin sections name the field only: say whose field it is.
            raise ConfigError(text if text.startswith(f"policies.{name}") else f"policies.{name}: {text}") from None
        pcfg._run_adapters = served  # the servers a policy's config starts serve every policy's adapter
        out[name] = pcfg
    return out
