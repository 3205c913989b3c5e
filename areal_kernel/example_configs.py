"""The example configs that ship inside the package, by name.

``areal train grpo-arithmetic`` runs ``examples/grpo_arithmetic.yaml`` from
wherever the package is installed, so a ``pip install areal-kernel`` user
needs no checkout. The files are the repository's ``examples/`` themselves:
``areal_kernel/examples`` is a link to that directory (one copy of each
file), which an editable install and ``PYTHONPATH`` read through, and which
a wheel build copies in as package data (pyproject.toml). Only the examples
that run with the kernel alone have a name here; the others need a package
the kernel does not install (the openai client, the example RFT plugin).

Cheap to import (no torch, no pydantic): ``areal examples`` and the name
lookup of every config argument go through it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from areal_kernel.errors import ConfigError

# How the shipped configs refer to the shipped data (relative to the
# repository root, where the README runs them from).
_REF_PREFIX = "examples/"


@dataclass(frozen=True)
class Example:
    name: str
    file: str  # in the examples directory
    description: str


EXAMPLES: tuple[Example, ...] = (
    Example(
        "grpo-arithmetic", "grpo_arithmetic.yaml", "the main job: async GRPO on single-digit sums, SmolLM2 on a CPU"
    ),
    Example(
        "dr-grpo-arithmetic", "dr_grpo_arithmetic.yaml", "Dr.GRPO: group-mean baseline without std, token-sum loss"
    ),
    Example("dapo-arithmetic", "dapo_arithmetic.yaml", "DAPO: clip-higher, dynamic sampling, overlong penalty"),
    Example("gspo-arithmetic", "gspo_arithmetic.yaml", "GSPO: one clipped importance ratio per sequence"),
    Example("rloo-arithmetic", "rloo_arithmetic.yaml", "RLOO: leave-one-out baseline within each prompt's group"),
    Example("reinforce-pp-arithmetic", "reinforce_pp_arithmetic.yaml", "REINFORCE++: discounted returns, KL in reward"),
    Example("ppo-arithmetic", "ppo_arithmetic.yaml", "PPO with a critic (value head) and GAE"),
    Example("grpo-lora", "grpo_lora.yaml", "GRPO training a LoRA adapter; the server serves it beside the base"),
    Example("grpo-multi-turn", "grpo_multi_turn.yaml", "multi-turn GRPO: a wrong answer gets feedback and a retry"),
    Example(
        "two-tasks-arithmetic",
        "two_tasks_arithmetic.yaml",
        "two policies in one run: an addition and a subtraction adapter on one base",
    ),
    Example(
        "selfplay-arithmetic",
        "selfplay_arithmetic.yaml",
        "two policies, two roles in one episode: one writes sums, the other answers them",
    ),
    Example("sft-chat", "sft_chat.yaml", "supervised fine-tuning on chat records (data shipped with it)"),
    Example("dpo-arithmetic", "dpo_arithmetic.yaml", "DPO (algorithm.type=ipo: IPO) on right vs wrong sums"),
    Example("rm-preferences", "rm_preferences.yaml", "a Bradley-Terry reward model on preference pairs (data shipped)"),
    Example("vlm-shapes-sft", "vlm_shapes_sft.yaml", "vision-language stage 1: SFT of a tiny random VLM on shapes"),
    Example(
        "vlm-shapes",
        "vlm_shapes.yaml",
        "vision-language stage 2: GRPO from stage 1 (run vlm-shapes-sft first, same dir)",
    ),
    Example("agent-online", "agent_online.yaml", "online agent training: `areal agent serve agent-online`"),
)

# The examples/*.yaml files deliberately without a name, and why (a test
# checks that every example file is named or listed here).
NOT_NAMED: dict[str, str] = {
    "agent_openai.yaml": "needs the openai client and examples/agent_openai.py",
    "rft_arithmetic.yaml": "needs the example plugin in examples/rft_plugin",
}


def examples_dir() -> Path:
    """The directory the shipped example configs are in."""
    # A directory on disk wherever the package is installed from (a wheel
    # unpacked into site-packages, a checkout); not a zip import.
    return Path(str(files("areal_kernel").joinpath("examples")))


def names() -> list[str]:
    return [e.name for e in EXAMPLES]


def find(name: str) -> Example | None:
    # `grpo_arithmetic` (the file's stem) is the same example; a file name
    # (`grpo_arithmetic.yaml`) is not: a missing file stays an error.
    key = name.replace("_", "-")
    return next((e for e in EXAMPLES if e.name == key), None)


def path_of(example: Example) -> Path:
    return examples_dir() / example.file


def _unknown(arg: str) -> ConfigError:
    return ConfigError(
        f"{arg}: no such config file, and no example has that name; examples: {', '.join(names())} "
        f"(`areal examples` describes them)"
    )


def config_argument(arg: str) -> str:
    """The config file a command's CONFIG argument means: a path that
    exists wins; else a shipped example's name; else the argument as given
    when it looks like a file (the loader then says it is not found);
    else one error naming it and the examples."""
    if os.path.exists(arg):
        return arg
    example = find(arg)
    if example is not None:
        return str(path_of(example))
    if os.sep in arg or "/" in arg or arg.endswith((".yaml", ".yml", ".json")):
        return arg
    raise _unknown(arg)


def is_shipped(config_path: str) -> bool:
    """``config_path`` is one of the shipped example files (by its real
    location: in a checkout that is the repository's examples/)."""
    try:
        return os.path.samefile(os.path.dirname(os.path.abspath(config_path)), examples_dir())
    except OSError:
        return False


def _shipped_ref(value: str) -> str | None:
    if not value.startswith(_REF_PREFIX) or os.path.exists(value):
        return None
    target = examples_dir() / value[len(_REF_PREFIX) :]
    return str(target) if target.is_file() else None


def resolve_shipped_refs(config_path: str, data: dict[str, Any]) -> dict[str, Any]:
    """A shipped example's ``examples/...`` file references (its dataset),
    written relative to the repository root, pointed at the shipped files
    when they do not exist from the working directory: the example then runs
    from anywhere. Any other config is returned as it is."""
    if not is_shipped(config_path):
        return data

    def fix(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, str):
            return _shipped_ref(value) or value
        return value

    return fix(data)


def copy(name: str, dest: str | None = None) -> Path:
    """Write example ``name`` to ``dest`` (a file, or a directory to put it
    in; default: the working directory) for editing; never overwrites. Its
    references to shipped data become absolute paths, so the copy runs from
    any directory."""
    example = find(name)
    if example is None:
        raise _unknown(name)
    target = Path(dest) if dest else Path(example.file)
    if target.is_dir():
        target = target / example.file
    if target.exists():
        raise ConfigError(f"{target} exists; not overwriting it (give another DEST: areal examples copy {name} DEST)")
    text = "".join(_absolute_refs(line) for line in path_of(example).read_text(encoding="utf-8").splitlines(True))
    target.parent.mkdir(parents=True, exist_ok=True)
    # "x": a file that appeared since the check above is still not overwritten.
    try:
        with open(target, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise ConfigError(f"{target} exists; not overwriting it") from None
    return target


def _absolute_refs(line: str) -> str:
    """``line`` with the shipped files its value names as absolute paths;
    its comment stays as written. Unlike at load time the working directory
    does not matter: the copy is meant to leave the repository."""
    # A YAML comment starts at a "#" at the line's start or after a space.
    match = re.search(r"(^|\s)#", line)
    cut = match.start() if match else len(line)
    out = []
    for word in line[:cut].split(" "):
        bare = word.strip("'\"\n")
        if bare.startswith(_REF_PREFIX) and (examples_dir() / bare[len(_REF_PREFIX) :]).is_file():
            word = word.replace(bare, str(examples_dir() / bare[len(_REF_PREFIX) :]))
        out.append(word)
    return " ".join(out) + line[cut:]


def listing() -> str:
    width = max(len(e.name) for e in EXAMPLES)
    lines = [f"{e.name:<{width}}  {e.description}" for e in EXAMPLES]
    lines += [
        "",
        "run one:  areal train NAME [key=value ...]   (also validate, check, plan)",
        "edit one: areal examples copy NAME [DEST]",
    ]
    return "\n".join(lines)
