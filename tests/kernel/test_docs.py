"""The plugin-authoring page documents every hook with its exact signature."""
import inspect
from pathlib import Path

from areal_kernel import hookspecs

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugin-authoring.md"


def _hooks():
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if name.startswith("areal_") and callable(fn) and getattr(fn, "areal_spec", None) is not None
    }


def test_every_hook_is_documented_with_its_signature():
    text = DOC.read_text(encoding="utf-8")
    hooks = _hooks()
    assert len(hooks) >= 20
    missing = []
    for name, fn in hooks.items():
        sig = f"def {name}{inspect.signature(fn)}".replace("'", "").replace('"', "")
        if sig not in text:
            missing.append(sig)
    assert missing == [], "undocumented hooks (add them to docs/plugin-authoring.md):\n" + "\n".join(missing)


def test_every_hook_has_a_docstring():
    for name, fn in _hooks().items():
        assert (fn.__doc__ or "").strip(), name
