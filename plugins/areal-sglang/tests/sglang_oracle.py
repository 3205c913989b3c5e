"""SGLang's own code as a compatibility oracle, served over HTTP to the tests.

Runs in a separate process with the pinned ``sglang`` wheel installed without
its CUDA dependencies (see ``ORACLE_SITE`` in conftest.py). It imports the
real ``sglang.srt.server_args`` and ``sglang.srt.managers.io_struct`` and
answers these questions:

- ``POST /check_argv {"argv": [...], "fields": [...]}``: does SGLang's own server-argument
  parser (``prepare_server_args``: ``ServerArgs.add_cli_args`` + argparse +
  ``ServerArgs.from_cli_args``) accept this launch command, and which values
  did it parse?
- ``POST /check_request {"route": ..., "body": ...}``: does the request class
  that SGLang's HTTP route declares accept this JSON body, the way FastAPI
  validates it (pydantic, JSON mode)? Unknown keys are reported too, because
  SGLang's schema silently ignores them. ``/generate`` bodies additionally go
  through the route's JSON contract gate, ``normalize_batch_and_arguments``
  and ``SamplingParams(**sampling_params).verify``, as the tokenizer manager does.

- ``POST /check_response {"route": ..., "body": ...}``: does SGLang's response
  class for that route (``/v1/models``: ``ModelList`` of ``ModelCard``) accept
  this answer (pydantic), with no key it does not declare? For the stand-in's
  answers that the plugin parses.

- ``POST /sglang_weights/{init,receive,destroy}``: SGLang's own
  ``WeightUpdater`` joins a weight-update group and receives broadcast
  weights (``load_format`` as sent), answering with a sha256 per tensor
  (see ``WeightReceiver``; there is no model to load them into).

What is NOT real here: SGLang imports a few GPU-only or media packages at
module top level that cannot load on these machines; they are replaced by
inert placeholder modules (``triton`` when it is not installed, ``torchvision``)
or hidden (``torchcodec``, ``torchaudio``). None of them takes part in argument
parsing or request validation.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import traceback
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Inert:
    """Attribute access and calls on a placeholder module return more placeholders;
    decorators return the function unchanged."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, k: str) -> Any:
        if k.startswith("__"):
            raise AttributeError(k)
        return _Inert(f"{self._name}.{k}")

    def __call__(self, *a: Any, **k: Any) -> Any:
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]
        return _Inert(f"{self._name}()")

    def __getitem__(self, k: Any) -> Any:
        return self

    def __iter__(self) -> Any:
        return iter(())

    def __mro_entries__(self, bases: Any) -> tuple:
        return (object,)


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        m = types.ModuleType(spec.name)
        m.__path__ = []

        def getattr_(k: str, _n: str = spec.name) -> Any:
            if k.startswith("__"):
                raise AttributeError(k)
            return _Inert(f"{_n}.{k}")

        m.__getattr__ = getattr_  # type: ignore[attr-defined]
        m.__version__ = "0.0.0"  # type: ignore[attr-defined]
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_sglang() -> dict[str, Any]:
    for hidden in ("torchcodec", "torchaudio"):
        sys.modules[hidden] = None  # type: ignore[assignment]
    import torch  # noqa: F401  (the real CPU torch)
    import torch.utils._triton as torch_triton

    placeholders = {"torchvision"}  # the PyPI build cannot load beside the CPU torch
    if importlib.util.find_spec("triton") is None:
        placeholders.add("triton")
    # Let torch settle its own optional imports (triton probe, dynamo, inductor)
    # *before* placeholders exist, so torch never mistakes one for the real thing.
    torch_triton.has_triton_package()
    import functorch.compile  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.utils  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401

    sys.meta_path.insert(0, _PlaceholderFinder(placeholders))

    import msgspec
    import pydantic
    import sglang
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.entrypoints.openai.protocol import ModelCard, ModelList
    from sglang.srt.managers import io_struct as io
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import prepare_server_args

    routes = {
        "/generate": io.GenerateReqInput,
        "/pause_generation": io.PauseGenerationReqInput,
        "/continue_generation": io.ContinueGenerationReqInput,
        "/update_weights_from_disk": io.UpdateWeightFromDiskReqInput,
        "/init_weights_update_group": io.InitWeightsUpdateGroupReqInput,
        "/update_weights_from_distributed": io.UpdateWeightsFromDistributedReqInput,
        "/begin_weight_update": io.BeginWeightUpdateReqInput,
        "/end_weight_update": io.EndWeightUpdateReqInput,
        "/destroy_weights_update_group": io.DestroyWeightsUpdateGroupReqInput,
        "/update_weight_version": io.UpdateWeightVersionReqInput,
        "/abort_request": io.AbortReq,
        "/release_memory_occupation": io.ReleaseMemoryOccupationReqInput,
        "/resume_memory_occupation": io.ResumeMemoryOccupationReqInput,
        "/load_lora_adapter": io.LoadLoRAAdapterReqInput,
        "/unload_lora_adapter": io.UnloadLoRAAdapterReqInput,
        "/get_weights_by_name": io.GetWeightsByNameReqInput,
    }
    return {
        "responses": {"/v1/models": (ModelList, {"data": ModelCard})},
        "version": getattr(sglang, "__version__", "?"),
        "msgspec": msgspec,
        "pydantic": pydantic,
        "routes": routes,
        "SamplingParams": SamplingParams,
        "generate_contract_error": generate_contract_error,
        "prepare_server_args": prepare_server_args,
    }


def field_names(cls: type, msgspec: Any) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return {f.name for f in msgspec.structs.fields(cls)}


def check_request(sg: dict[str, Any], route: str, body: Any) -> dict[str, Any]:
    cls = sg["routes"].get(route)
    if cls is None:
        return {"ok": False, "error": f"no request class known for {route}; known: {sorted(sg['routes'])}"}
    if not isinstance(body, dict):
        return {"ok": False, "error": "body must be a JSON object"}
    unknown = sorted(set(body) - field_names(cls, sg["msgspec"]))
    if unknown:
        return {"ok": False, "error": f"{cls.__name__} has no field(s) {unknown} (SGLang would silently drop them)"}
    try:
        obj = sg["pydantic"].TypeAdapter(cls).validate_json(json.dumps(body))
    except Exception as e:  # pydantic.ValidationError and errors of the class's own __post_init__
        return {"ok": False, "error": f"{cls.__name__} rejected the body: {e}"}
    if route == "/generate":
        err = sg["generate_contract_error"](body)
        if err is not None:
            return {"ok": False, "error": f"/generate contract gate: {err}"}
        try:
            obj.normalize_batch_and_arguments()
            sp = sg["SamplingParams"](**(body.get("sampling_params") or {}))
            sp.verify(vocab_size=1 << 20)
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "error": None, "class": f"{cls.__module__}.{cls.__qualname__}"}


def check_response(sg: dict[str, Any], route: str, body: Any) -> dict[str, Any]:
    known = sg["responses"].get(route)
    if known is None:
        return {"ok": False, "error": f"no response class known for {route}; known: {sorted(sg['responses'])}"}
    cls, items = known
    if not isinstance(body, dict):
        return {"ok": False, "error": "body must be a JSON object"}
    # Keys the classes do not declare (pydantic would drop them silently), at the top and in each list item.
    unknown = sorted(set(body) - set(cls.model_fields))
    for key, item_cls in items.items():
        for i, x in enumerate(body.get(key) or []):
            unknown += [f"{key}[{i}].{k}" for k in sorted(set(x) - set(item_cls.model_fields))]
    if unknown:
        return {"ok": False, "error": f"{cls.__name__} has no field(s) {unknown}"}
    try:
        cls.model_validate_json(json.dumps(body))
    except Exception as e:
        return {"ok": False, "error": f"{cls.__name__} rejected the answer: {e}"}
    return {"ok": True, "error": None, "class": f"{cls.__module__}.{cls.__qualname__}"}


FIELDS = (
    "model_path",
    "host",
    "port",
    "dtype",
    "tp_size",
    "random_seed",
    "weight_version",
    "context_length",
    "mem_fraction_static",
    "attention_backend",
    "device",
    "disable_radix_cache",
    "enable_memory_saver",
    "skip_server_warmup",
    "api_key",
    "log_level",
)


def check_argv(sg: dict[str, Any], argv: list[str], extra_fields: tuple[str, ...] = ()) -> dict[str, Any]:
    import contextlib
    import io as _io

    err = _io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = sg["prepare_server_args"](list(argv))
    except SystemExit as e:  # argparse rejects with exit code 2 and a usage message
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln] or err.getvalue().splitlines()[-1:]
        return {"ok": False, "error": f"SGLang's argument parser exited with {e.code}: {' '.join(lines)[-800:]}"}
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    fields = {k: getattr(args, k, None) for k in FIELDS}
    fields.update({k: _plain(getattr(args, k, None)) for k in extra_fields})
    return {"ok": True, "error": None, "fields": fields}


def _plain(v: Any) -> Any:
    """Sets (SGLang keeps some list flags as sets) as sorted lists, for JSON."""
    return sorted(v) if isinstance(v, (set, frozenset)) else v


class WeightReceiver:
    """SGLang's own receiving side of in-memory weight updates: a real
    ``WeightUpdater`` (model_runner_components/weight_updater.py) whose
    ``init_weights_update_group`` and ``receive_weights_from_distributed`` run
    unchanged on CPU/gloo. What is not real: there is no model (the received
    tensors are hashed instead of loaded) and the TP default group it asserts
    is a one-rank gloo group."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._updater: Any = None

    def updater(self) -> Any:
        with self._lock:
            if self._updater is None:
                import torch.distributed as dist
                from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

                if not dist.is_initialized():
                    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                self._updater = WeightUpdater(
                    tp_rank=0,
                    device="cpu",
                    gpu_id=0,
                    model_config=None,
                    custom_weight_loaders={},
                    get_model=lambda: None,
                    update_model_fields=lambda **k: None,
                    recapture_cuda_graph=lambda: None,
                    get_model_runner=lambda: None,
                )
            return self._updater

    def handle(self, path: str, req: dict) -> dict:
        import hashlib

        import torch

        u = self.updater()
        if path == "/sglang_weights/init":
            ok, msg = u.init_weights_update_group(
                req["master_address"],
                req["master_port"],
                req["rank_offset"],
                req["world_size"],
                req["group_name"],
                req["backend"],
            )
            return {"success": ok, "message": msg}
        if path == "/sglang_weights/receive":
            weights = u.receive_weights_from_distributed(
                names=req["names"],
                dtypes=req["dtypes"],
                shapes=req["shapes"],
                group_name=req["group_name"],
                load_format=req.get("load_format"),
            )
            sums = {
                n: hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, t in weights
            }
            return {"success": True, "checksums": sums}
        if path == "/sglang_weights/destroy":
            ok, msg = u.destroy_weights_update_group(req["group_name"])
            return {"success": ok, "message": msg}
        raise KeyError(path)


def main() -> None:
    sg = import_sglang()
    receiver = WeightReceiver()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def _send(self, code: int, obj: Any) -> None:
            raw = json.dumps(obj, default=str).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            self._send(200, {"sglang_version": sg["version"]})

        def do_POST(self) -> None:
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path == "/check_argv":
                    self._send(200, check_argv(sg, req["argv"], tuple(req.get("fields", ()))))
                elif self.path == "/check_request":
                    self._send(200, check_request(sg, req["route"], req.get("body")))
                elif self.path == "/check_response":
                    self._send(200, check_response(sg, req["route"], req.get("body")))
                elif self.path.startswith("/sglang_weights/"):
                    self._send(200, receiver.handle(self.path, req))
                else:
                    self._send(404, {"error": self.path})
            except Exception:
                self._send(500, {"ok": False, "error": traceback.format_exc()[-2000:]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"ORACLE READY {server.server_address[1]} sglang {sg['version']}", flush=True)
    parent = int(os.environ.get("AREAL_ORACLE_PARENT_PID", "0"))
    if parent:
        import threading
        import time

        def watch() -> None:  # never outlive the test session
            while True:
                time.sleep(1)
                try:
                    os.kill(parent, 0)
                except ProcessLookupError:
                    os._exit(0)

        threading.Thread(target=watch, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
