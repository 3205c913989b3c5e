"""The wire format of one inference-server backend, as the generic client sees it.

A backend plugin (embedded, vLLM, SGLang, ...) describes its HTTP routes and
bodies by subclassing ``ServerProtocol``; retries, affinity, failover,
interruption, version stamping, restarts and weight-group ranks live once, in
``RemoteInferenceEngine``.

Extension points (all public, all typed):

- a *control operation* (``ControlOp``) is one ``HttpCall`` or a sequence of
  them, run in order on one server; its result is the last call's parsed
  reply. Every control method of ``ServerProtocol`` may return either, so a
  backend whose "load weights from disk" is four routes returns four calls;
- ``HttpCall.parse`` turns the raw reply bytes into the result (default:
  JSON, ``{}`` for an empty body; ``text_reply`` for routes that answer plain
  text);
- ``HttpCall.json = None`` sends no body at all (``{}`` sends an empty JSON
  object);
- ``ServerProtocol.ranks_per_server``: how many ranks one server contributes
  to an in-memory weight group (its tensor-parallel workers); the client
  numbers ranks and sizes the group from it;
- backend-only operations (cache flushes, memory release, ...) are more
  ``ControlOp`` builders on the protocol, run with the client's public
  ``control`` / ``control_all`` / ``control_async``.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

from areal_kernel.api.io import GenerationConfig, ImageInputs, StopReason


def json_reply(raw: bytes) -> Any:
    """The default reply parser: JSON, or ``{}`` for an empty body."""
    return _json.loads(raw) if raw else {}


def text_reply(raw: bytes) -> dict[str, str]:
    """For routes that answer plain text: ``{"text": <the body>}``."""
    return {"text": raw.decode(errors="replace")}


@dataclass
class HttpCall:
    method: str
    path: str
    # The JSON body; None sends no body.
    json: dict[str, Any] | None = None
    # Control calls that load weights may take long; None = client default.
    timeout_s: float | None = None
    # Raw reply bytes -> result; None = ``json_reply``.
    parse: Callable[[bytes], Any] | None = None

    def parse_reply(self, raw: bytes) -> Any:
        return (self.parse or json_reply)(raw)


# One call, or calls run in order on one server (the result is the last reply).
ControlOp = Union[HttpCall, Sequence[HttpCall]]


def control_calls(op: ControlOp) -> list[HttpCall]:
    """The calls of a control operation, in order."""
    if isinstance(op, HttpCall):
        return [op]
    calls = list(op)
    if not calls or not all(isinstance(c, HttpCall) for c in calls):
        raise TypeError(f"a control operation is an HttpCall or a non-empty sequence of them, got {op!r}")
    return calls


@dataclass
class GenerateChunk:
    """What one ``/generate``-style call returned."""

    output_ids: list[int]
    output_logprobs: list[float]
    stop_reason: StopReason
    version: int | None = None  # weight version that produced these tokens
    extra: dict[str, Any] = field(default_factory=dict)
    # The stop string (of ``GenerationConfig.stop``) that ended this chunk,
    # as the server reported it; None when it stopped otherwise.
    matched_stop: str | None = None


class ServerProtocol:
    """Routes and bodies of a server backend. Override what differs.

    ``generate``/``parse_generate`` are required; the control operations
    below raise ``NotImplementedError`` unless the backend supports them
    (the kernel calls ``pause``/``resume``/``update_weights_from_disk`` on
    every weight update, the weight-group ones only with
    ``weight_update.mode: broadcast``)."""

    health_path: str = "/health"
    # Ranks one server contributes to an in-memory weight group (e.g. its
    # tensor-parallel workers); server i gets ranks 1 + i*n .. (i+1)*n.
    ranks_per_server: int = 1
    # Whether ``update_adapter_from_distributed`` is implemented (the server
    # takes a LoRA adapter's tensors from the weight group). Without it the
    # kernel's transports ship adapters as peft directories
    # (``load_adapter``), which every LoRA-capable backend loads.
    adapter_broadcast: bool = False
    # Whether an adapter update (``load_adapter``, ``update_adapter_from_distributed``)
    # interrupts only the running rows of that adapter, between the server's
    # steps, while the base's and other adapters' rows go on. Then the kernel's
    # transports update an adapter without pausing the server: several policies
    # on shared servers do not interrupt each other's episodes. Otherwise every
    # generation is paused for the update (no row may mix two versions).
    adapter_update_scoped: bool = False
    # For ``weight_fingerprint``: a server that can read only a tensor's
    # leading elements cheaply (SGLang's ``/get_weights_by_name`` returns the
    # first rows) sets how many; the trainer then samples positions among a
    # tensor's first ``fingerprint_prefix`` elements (flat order). None: anywhere.
    fingerprint_prefix: int | None = None

    def generate(self, rid: str, input_ids: list[int], gconfig: GenerationConfig, max_new_tokens: int) -> HttpCall:
        raise NotImplementedError

    def parse_generate(self, data: Any) -> GenerateChunk:
        raise NotImplementedError

    # Whether ``add_images`` is implemented (the backend serves vision-language
    # models and takes a request's images with its token ids).
    supports_images: bool = False

    def add_images(self, call: HttpCall, images: ImageInputs) -> HttpCall:
        """``call`` (what ``generate`` built) with the request's ``images``
        added in this backend's own format. The token ids already hold the
        image placeholder tokens; the server runs the model's image processor
        on the files. Called for every call of a request with images."""
        raise NotImplementedError(
            f"{type(self).__name__} does not take images (supports_images is False): "
            "serve vision-language models with a backend that does"
        )

    def pause(self, mode: str = "abort") -> ControlOp:
        raise NotImplementedError

    def resume(self) -> ControlOp:
        raise NotImplementedError

    def update_weights_from_disk(self, path: str, version: int) -> ControlOp:
        raise NotImplementedError

    def init_weight_group(
        self, master_addr: str, master_port: int, world_size: int, rank: int, group_name: str, backend: str
    ) -> ControlOp:
        """``rank``: this server's first rank (it owns ``ranks_per_server`` ranks from there)."""
        raise NotImplementedError

    def update_weights_from_distributed(
        self, tensors: list[dict[str, Any]], version: int, bucket_bytes: int, group_name: str
    ) -> ControlOp:
        raise NotImplementedError

    def set_version(self, version: int) -> ControlOp:
        raise NotImplementedError

    def server_info(self) -> ControlOp:
        """What a server says about itself, as a dict: ``weight_version``
        (int, the version it serves) and ``identity`` (``{model_type,
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
        tokenizer}`` as ``areal_kernel.inference.fleet.model_identity``
        computes them from its model directory); either may be missing.
        The fleet checks a joining server's identity against the run's
        model before admitting it and ``areal fleet status`` shows the
        version. Without it a joining server is checked by its first weight
        load (tensor names and shapes) only."""
        raise NotImplementedError

    def weight_fingerprint(self, spec: dict[str, Any]) -> ControlOp:
        """The weight-delivery check's route (``monitor.weights``): the server
        answers ``areal_kernel.monitor.weights.fingerprint`` of the tensors it
        serves for ``spec`` (``FingerprintSpec.to_json()``: version, adapter or
        null, and per tensor its HF name, the flat element positions and its
        shape as sent):
        ``{"version": <served version or null>, "tensors": {name: {"dtype",
        "numel", "n", "bits", "wbits", "sum"}}, "missing": [names],
        "unreadable": [names]}`` (``unreadable``, optional: tensors the server
        holds in a form it cannot read back, e.g. repacked for its kernels;
        not compared and left out of later samples), over
        the tensors as loaded (after any dtype conversion, before any fusion
        the trainer does not do). Without it the check is skipped.

        A server that can tell which version it serves but cannot read the
        tensors back answers ``{"version": <int or null>, "tensors": {},
        "version_only": "<why, and what it serves>"}``: only the version is
        compared. For an adapter loaded from a directory the client adds
        ``spec["adapter_dirs"]`` (``{path: version}`` of the directories it
        told the servers to load lately), so a protocol whose servers report
        the directory they loaded (SGLang's ``/v1/models``) can map it back
        to a version."""
        raise NotImplementedError

    # -- LoRA adapters (backends that serve adapters beside the base weights) --
    # ``generate`` reads the adapter a request names from ``gconfig.adapter``.
    def load_adapter(self, name: str, path: str, version: int, replace: bool) -> ControlOp:
        """Serve the peft adapter directory ``path`` under ``name`` as weight
        ``version`` (``replace``: the server already serves ``name``; its
        running requests of that adapter are interrupted like a weight update)."""
        raise NotImplementedError

    def unload_adapter(self, name: str) -> ControlOp:
        raise NotImplementedError

    def update_adapter_from_distributed(
        self,
        name: str,
        config: dict[str, Any],
        tensors: list[dict[str, Any]],
        version: int,
        bucket_bytes: int,
        group_name: str,
    ) -> ControlOp:
        """Like ``update_weights_from_distributed`` for the adapter ``name``
        (``config``: its peft ``adapter_config.json``); only with ``adapter_broadcast``."""
        raise NotImplementedError
