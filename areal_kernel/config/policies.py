"""Several policies in one run (``policies:``): each policy's own config.

A multi-policy run shares ``model``, ``actor`` (one train engine holding an
adapter per policy), ``rollout`` (one set of servers serving every adapter)
and ``logging``; each policy brings its data, workflow, reward and knobs
(``PolicyConfig``). ``policy_config_data`` builds a policy's whole config
mapping from the run's: a section a policy gives replaces the run's when it
names another ``type``, else its keys are merged over the run's.
``config.loader.check_policies`` validates every policy's config and the
engine settings of all adapters together, so one ``ConfigError`` naming
``policies.<name>.<field>`` comes before anything starts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_kernel.errors import ConfigError

if TYPE_CHECKING:
    from areal_kernel.config.models import ExperimentConfig

# Sections a policy may give (``PolicyConfig`` fields of the same name).
POLICY_SECTIONS = ("dataset", "workflow", "reward", "algorithm")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def policy_config_data(cfg: "ExperimentConfig", name: str) -> dict[str, Any]:
    """Policy ``name``'s whole config as a mapping (``validate_config`` turns
    it into an ``ExperimentConfig``): the run's, with the policy's sections,
    ``trainer.batch_size`` and ``rollout.max_staleness`` applied, and no
    ``policies`` of its own."""
    policy = cfg.policies[name]
    data = cfg.dump()
    data.pop("policies", None)
    for section in POLICY_SECTIONS:
        given = getattr(policy, section)
        if not given:
            continue
        if "type" in given and given["type"] != data.get(section, {}).get("type"):
            # Another plugin: the run's settings of its own plugin do not apply.
            data[section] = copy.deepcopy(given)
        else:
            data[section] = _merge(data.get(section, {}), given)
    if policy.batch_size is not None:
        data["trainer"]["batch_size"] = policy.batch_size
    if policy.max_staleness is not None:
        data["rollout"]["max_staleness"] = policy.max_staleness
    return data


def adapter_settings(cfg: "ExperimentConfig") -> Any:
    """The actor engine's validated settings with one adapter per policy
    (``adapters: [{name: <policy>, **policies.<policy>.lora}, ...]``), or one
    ``ConfigError`` naming the policy's ``lora`` field, or the engine that
    cannot hold several adapters."""
    from pydantic import ValidationError

    from areal_kernel.config.sections import format_validation_error

    engine_cfg = cfg.actor.plugin_config
    where = f"{cfg.actor.where}.{cfg.actor.selected_name}"
    fields = getattr(type(engine_cfg), "model_fields", {})
    if "adapters" not in fields:
        raise ConfigError(
            f"policies: several policies need a train engine that holds one adapter per policy, and "
            f"actor.backend {cfg.actor.allocation.backend!r} has no 'adapters' setting ({where}); use "
            "actor.backend: torch"
        )
    if getattr(engine_cfg, "lora", None) is not None or getattr(engine_cfg, "adapters", None):
        raise ConfigError(
            f"policies: each policy's adapter is set under policies.<name>.lora; drop {where}.lora / {where}.adapters"
        )
    data = engine_cfg.model_dump()
    adapters = []
    for name, policy in cfg.policies.items():
        if "name" in policy.lora:
            raise ConfigError(f"policies.{name}.lora.name: the adapter is named after its policy ({name!r}); drop it")
        adapters.append({**policy.lora, "name": name})
    data["adapters"] = adapters
    try:
        return type(engine_cfg).model_validate(data)
    except ValidationError as e:
        msg = format_validation_error(e, model=type(engine_cfg))
        # The engine names adapters by position: name the policy instead.
        for i, name in enumerate(cfg.policies):
            msg = msg.replace(f"adapters.{i}.", f"policies.{name}.lora.")
        raise ConfigError(f"policies: the adapters' settings are invalid:\n{msg}") from None


@dataclass(frozen=True)
class ServedAdapters:
    """What the inference servers of a run must serve beside the base: the
    LoRA adapters it trains (one per policy, or the actor's ``lora``).
    Backends size their adapter slots from it (``served_adapters``)."""

    names: tuple[str, ...]
    max_rank: int
    # Every module some adapter targets, in first-seen order.
    target_modules: tuple[str, ...]

    @classmethod
    def of(cls, adapters: list[Any]) -> "ServedAdapters":
        modules: dict[str, None] = {}
        for a in adapters:
            modules.update(dict.fromkeys(a.target_modules))
        return cls(tuple(a.name for a in adapters), max(a.rank for a in adapters), tuple(modules))


def served_adapters(cfg: "ExperimentConfig") -> ServedAdapters | None:
    """The adapters a run's servers must serve, or None (the full model is
    trained): every policy's (a multi-policy run's config, or one policy's
    config built by ``check_policies``, which carries the run's), else the
    actor engine's ``lora``. For inference backends: ``--enable-lora`` and
    its rank, module and slot limits."""
    if cfg.policies:
        return ServedAdapters.of(list(adapter_settings(cfg).adapters))
    run = getattr(cfg, "_run_adapters", None)
    if run is not None:
        return run  # type: ignore[no-any-return]
    lora = getattr(cfg.actor.plugin_config, "lora", None)
    return ServedAdapters.of([lora]) if lora is not None else None
