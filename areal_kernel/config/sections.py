"""Config base classes, including sections whose shape a plugin defines.

``actor: {backend: fsdp:d2, fsdp: {...}}``: the ``fsdp`` sub-section is
validated against the config model that the ``fsdp`` train engine registered,
so third-party backends get validated config without touching the kernel.
That second step needs the registry and happens in
``areal_kernel.config.resolve``; nothing here looks a plugin up.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from areal_kernel.config.allocation import Allocation, AllocationError, parse_allocation
from areal_kernel.errors import ConfigError


class StrictModel(BaseModel):
    """Unknown keys are errors (with a suggestion), assignments re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def format_validation_error(err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """One line per problem: ``path: message`` (with 'did you mean' for typos)."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        path = ".".join(([prefix] if prefix else []) + loc) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            if model is not None:
                known = _fields_at(model, e["loc"][:-1])
                close = difflib.get_close_matches(str(e["loc"][-1]), known, n=1)
                if close:
                    msg += f"; did you mean '{close[0]}'?"
                elif known:
                    msg += f"; valid keys: {', '.join(known)}"
        elif e["type"] == "missing":
            msg = "required key is missing"
        else:
            if "input" in e and e["type"] not in ("value_error",) and not isinstance(e["input"], (dict, list)):
                msg += f" (got {e['input']!r})"
        if e["type"] == "value_error" and msg.startswith("Value error, "):
            # Our validators' messages are already sentences; pydantic's prefix is noise.
            msg = msg[len("Value error, ") :]
            if not loc:  # a whole-config check names its fields itself
                lines.append(msg)
                continue
        lines.append(f"{path}: {msg}")
    return "\n".join(lines)


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    cls: Any = model
    for part in loc:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        cls = next(
            (a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)), None
        )
        if cls is None:
            return []
    return sorted(getattr(cls, "model_fields", {}))


class PluginSection(BaseModel):
    """A config section whose implementation is chosen by name from the registry.

    Subclasses set ``registry_kind`` (e.g. ``"train_engine"``), ``selector``
    (the field holding the name: ``"backend"`` or ``"type"``) and
    ``section_path`` (for messages). The plugin's own settings live under a
    key equal to the chosen name. Parsing checks the section's shape (the
    allocation string, no settings under another name);
    ``areal_kernel.config.resolve`` then checks the name against the registry
    and validates the settings against the model its plugin registered.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=False)

    registry_kind: ClassVar[str] = ""
    selector: ClassVar[str] = "type"
    section_path: ClassVar[str] = ""
    allocation_selector: ClassVar[bool] = False

    # Set by resolve(): the name whose settings it validated (a later change
    # of the selector leaves the section unresolved, not silently stale).
    _resolved_name: str | None = PrivateAttr(default=None)

    @property
    def where(self) -> str:
        """The section's path in messages (``actor``, ``rollout``, ...)."""
        return self.section_path or type(self).__name__

    @property
    def selected_name(self) -> str:
        value = getattr(self, self.selector)
        return parse_allocation(value).backend if self.allocation_selector else value

    @property
    def allocation(self) -> Allocation:
        return parse_allocation(getattr(self, self.selector))

    @property
    def plugin_config(self) -> Any:
        """The validated settings of the selected implementation (an instance
        of its config model, or ``None`` for one without)."""
        require_resolved(self._resolved_name == self.selected_name, f"{self.where}.{self.selected_name}")
        return (self.__pydantic_extra__ or {}).get(self.selected_name)

    @model_validator(mode="after")
    def _section_shape(self) -> "PluginSection":
        where = self.where
        if self.allocation_selector:
            try:
                parse_allocation(getattr(self, self.selector))
            except AllocationError as e:
                raise ConfigError(f"{where}.{self.selector}: {e}") from None
        name = self.selected_name
        for key in self.__pydantic_extra__ or {}:
            if key == name:
                continue
            close = difflib.get_close_matches(key, [name, *type(self).model_fields], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{where}.{key}: unknown key{hint} (settings for the selected {self.registry_kind} "
                f"'{name}' go under {where}.{name})"
            )
        return self


class RoleEnvironment(BaseModel):
    """Mixed into a plugin's settings section whose processes may run from
    their own Python environment (``rollout.vllm``): adds ``python``.

    The subclass sets ``environment`` to the name it registered through
    ``areal_register_environments`` (``"vllm"``): what that environment
    must hold. ``areal validate`` and the launcher resolve ``python`` with
    ``areal_kernel.environments.resolve_python`` and probe it against that
    spec; the plugin starts its processes with the resolved interpreter."""

    environment: ClassVar[str] = ""

    python: str | None = Field(
        None,
        description="The interpreter this role's processes run from: a managed environment's name (`areal env "
        "create NAME`), a path to a python executable or to a venv directory; unset: this interpreter when it "
        "has the backend's packages, else the managed environment named after the backend.",
    )


def require_resolved(resolved: bool, where: str) -> None:
    """Refuse to hand out plugin settings of a config that was only parsed:
    until ``resolve`` validated them they are the user's raw mapping."""
    if not resolved:
        raise ConfigError(
            f"{where}: the config was parsed but not resolved against the plugin registry, so its plugin "
            "settings are not validated yet; call areal_kernel.config.resolve(config, get_registry()) "
            "(load_config and validate_config do when given registry=)"
        )


def validate_settings(where: str, kind: str, name: str, raw: Any, *, spec: Any = None) -> BaseModel | None:
    """``raw`` (the user's ``where: {...}`` mapping, or ``None``) validated
    against the ``config_model`` of ``spec``, the factory registered for
    ``kind`` ``name`` (``registry.get(kind, name)``): an instance of that
    model (defaults filled in), or ``None`` for a factory without one.
    Every kind's settings go through here, so each gives the same errors."""
    if spec is None:
        # The config layer does not look plugins up itself (it sits below them).
        raise TypeError(
            f"validate_settings({where!r}, ...): pass spec=, the registered factory "
            f"(get_registry().get({kind!r}, {name!r}, platform=''))"
        )
    model_cls = spec.config_model_cls()
    if isinstance(raw, BaseModel):
        if model_cls is not None and isinstance(raw, model_cls):
            return raw
        raw = raw.model_dump()
    if model_cls is None:
        if raw:
            raise ConfigError(f"{where}: {kind} '{name}' takes no settings")
        return None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of settings, got {type(raw).__name__}")
    try:
        return model_cls.model_validate(raw)
    except ValidationError as ve:
        raise ConfigError(format_validation_error(ve, prefix=where, model=model_cls)) from None


def settings_kwargs(settings: BaseModel | None) -> dict[str, Any]:
    """Validated settings as keyword arguments: every field, defaults included
    (so the config model holds the only defaults), values as validated (a
    nested model stays a model). ``None`` (no config model) gives none."""
    if settings is None:
        return {}
    return {k: getattr(settings, k) for k in type(settings).model_fields}


def unknown_section_error(where: str, key: str, known: list[str], what: str) -> ConfigError:
    """The error for ``where.key`` that is neither a field nor an allowed
    settings section: a 'did you mean' among ``known`` when one is close, and
    ``what`` says which sections are allowed here."""
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"{where}.{key}: unknown key{hint} ({what})")
