"""Config base classes, including sections whose shape a plugin defines.

``actor: {backend: fsdp:d2, fsdp: {...}}``: the ``fsdp`` sub-section is
validated against the config model that the ``fsdp`` train engine registered,
so third-party backends get validated config without touching the kernel.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

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
    key equal to the chosen name and are validated against its model.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=False)

    registry_kind: ClassVar[str] = ""
    selector: ClassVar[str] = "type"
    section_path: ClassVar[str] = ""
    allocation_selector: ClassVar[bool] = False

    @property
    def selected_name(self) -> str:
        value = getattr(self, self.selector)
        return parse_allocation(value).backend if self.allocation_selector else value

    @property
    def allocation(self) -> Allocation:
        return parse_allocation(getattr(self, self.selector))

    @property
    def plugin_config(self) -> Any:
        """The validated settings of the selected implementation (model or dict)."""
        return (self.__pydantic_extra__ or {}).get(self.selected_name)

    @model_validator(mode="after")
    def _validate_plugin_section(self) -> "PluginSection":
        from areal_kernel.plugins.registry import get_registry

        where = self.section_path or type(self).__name__
        if self.allocation_selector:
            try:
                parse_allocation(getattr(self, self.selector))
            except AllocationError as e:
                raise ConfigError(f"{where}.{self.selector}: {e}") from None
        name = self.selected_name
        try:
            spec = get_registry().get(self.registry_kind, name)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"{where}.{self.selector}: {e}") from None
        if self.__pydantic_extra__ is None:
            self.__pydantic_extra__ = {}
        extras = self.__pydantic_extra__
        for key in list(extras):
            if key == name:
                continue
            close = difflib.get_close_matches(key, [name, *type(self).model_fields], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{where}.{key}: unknown key{hint} (settings for the selected {self.registry_kind} "
                f"'{name}' go under {where}.{name})"
            )
        extras[name] = validate_settings(f"{where}.{name}", self.registry_kind, name, extras.get(name), spec=spec)
        if extras[name] is None:
            del extras[name]
        if self.allocation_selector:
            # A backend's config model may check the dims of its allocation
            # (``check_allocation(allocation, where)``, raising ConfigError), so
            # that `areal validate` refuses e.g. parallelism it cannot run.
            check = getattr(spec.config_model_cls(), "check_allocation", None)
            if callable(check):
                check(self.allocation, f"{where}.{self.selector}")
        return self


def validate_settings(where: str, kind: str, name: str, raw: Any, *, spec: Any = None) -> BaseModel | None:
    """``raw`` (the user's ``where: {...}`` mapping, or ``None``) validated
    against the ``config_model`` registered for ``kind`` ``name``: an instance
    of that model (defaults filled in), or ``None`` for a factory without one.
    Every kind's settings go through here, so each gives the same errors."""
    from areal_kernel.plugins.registry import get_registry

    if spec is None:
        spec = get_registry().get(kind, name, platform="")
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
