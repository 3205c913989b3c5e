"""The inference-backend contract is documented: every public member of the
backend base class, of the subprocess launcher a backend overrides, of the
wire protocol and every client extension point appears in
docs/plugin-authoring.md (in backticks), so the page cannot fall behind the
code a plugin is written against."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugin-authoring.md"


def _own_public(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and (callable(v) or isinstance(v, property)
                                                                          or not inspect.isroutine(v))}


def test_backend_launcher_protocol_and_client_extension_points_are_documented():
    from areal_kernel.inference.backend import InferenceBackend
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.launcher import SubprocessLauncher
    from areal_kernel.inference.wire import HttpCall, ServerProtocol

    text = DOC.read_text(encoding="utf-8")
    names = (_own_public(InferenceBackend) | _own_public(SubprocessLauncher) | _own_public(ServerProtocol)) - {
        "servers", "healthy", "log_tail", "kill", "failure",  # called by the kernel, not overridden
    }
    names |= {"control", "control_all", "control_async", "weight_group_world_size", "client_options",
              "ServerUnreachable", "json_reply", "text_reply", "rollout.client_keepalive_s"}
    names |= {f.name for f in HttpCall.__dataclass_fields__.values()}
    fences = re.findall(r"```.*?```", text, flags=re.S)
    spans = fences + re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", " ", text, flags=re.S))
    missing = sorted(n for n in names if not any(re.search(rf"(?<!\w){re.escape(n)}\b", sp) for sp in spans))
    assert missing == [], f"document these in docs/plugin-authoring.md (Inference backends): {missing}"
    assert callable(RemoteInferenceEngine.control_all)
