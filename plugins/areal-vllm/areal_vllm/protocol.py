"""vLLM's HTTP routes as the kernel's generic client sees them (no vLLM import).

Everything goes through vLLM's own routes:

- generation: ``POST /inference/v1/generate`` (``--enable-scale-out``): token
  ids in; ids, per-token logprobs and ``weight_versions`` spans out;
- ``POST /pause?mode=abort|keep|wait``, ``POST /resume`` (dev mode);
- disk update: ``POST /collective_rpc`` ``reload_weights`` (vLLM's in-place
  reload), then ``/reset_prefix_cache`` and ``/update_weight_version``;
- in-memory update: ``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update`` (with the new version), served by
  the transfer engine our worker extension registers.

Some kernel operations are several vLLM calls; the protocol describes them as
a list of ``HttpCall`` run in order (a kernel ``ControlOp``), and every
server gets ``tp_size`` ranks of an in-memory weight group
(``ranks_per_server``). All retries, affinity, failover, interruption,
restart and weight-group logic stay the kernel's.
"""

from __future__ import annotations

import json
from typing import Any

from areal_kernel.api.io import GenerationConfig, ImageInputs, StopReason
from areal_kernel.errors import ServerError
from areal_kernel.inference.client import RemoteInferenceEngine
from areal_kernel.inference.wire import ControlOp, GenerateChunk, HttpCall, ServerProtocol, text_reply
from areal_kernel.models.vision import ImagePlaceholders, image_data_url

PAUSE_MODES = ("abort", "keep", "wait")
_FINISH = {"stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORT}
# Loading weights may take a while on big models; None would mean the client default.
_LOAD_TIMEOUT_S = 1800.0


def parse_version(v: Any) -> int | None:
    """vLLM weight versions are strings ("default" until one is set); ours are ints."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    return None


class VLLMProtocol(ServerProtocol):
    health_path = "/health"

    def __init__(self, tp_size: int = 1, image_placeholders: ImagePlaceholders | None = None) -> None:
        # Every worker of a server joins the weight group (ranks are per worker).
        self.tp_size = tp_size
        # A vision-language model's placeholder layout (None: a text model).
        self.image_placeholders = image_placeholders

    @property
    def supports_images(self) -> bool:  # type: ignore[override]
        return self.image_placeholders is not None

    def add_images(self, call: HttpCall, images: ImageInputs) -> HttpCall:
        """vLLM's own multimodal form of ``/inference/v1/generate``: the images
        as ``content_parts`` (data URLs) and the token ids with ONE image token
        per image, which vLLM's processor expands to the model's placeholders
        (exactly the kernel's expanded ids; checked by the tests)."""
        if self.image_placeholders is None:
            raise ServerError("this vLLM server's model is not a vision-language model: requests cannot carry images")
        assert call.json is not None
        body = dict(call.json)
        body["token_ids"] = self.image_placeholders.collapse(body["token_ids"])
        body["content_parts"] = [{"type": "image_url", "url": image_data_url(f)} for f in images.files]
        return HttpCall(call.method, call.path, body, call.timeout_s, call.parse)

    @property
    def ranks_per_server(self) -> int:  # type: ignore[override]
        return max(1, self.tp_size)

    # -- generation ----------------------------------------------------------------
    def sampling_params(self, gconfig: GenerationConfig, max_new_tokens: int) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_tokens": max_new_tokens,
            "temperature": 0.0 if gconfig.greedy else gconfig.temperature,
            "top_p": gconfig.top_p,
            # 0 = disabled in vLLM; the kernel uses -1 (or 0) for the same.
            "top_k": gconfig.top_k if gconfig.top_k > 0 else 0,
            # logprobs=0: the sampled token's own logprob only (raw model
            # distribution: vLLM's default logprobs_mode is raw_logprobs).
            "logprobs": 0,
            # Stop only where the kernel says so (the workflow passes EOS in
            # stop_token_ids), exactly like the embedded server.
            "ignore_eos": True,
            "stop_token_ids": list(gconfig.stop_token_ids),
            "detokenize": False,
        }
        if gconfig.stop:
            # vLLM matches stop strings on detokenized text only; the token
            # ids it returns still hold every sampled token. Special tokens
            # stay in that text: a stop string may be one.
            sp.update(
                stop=list(gconfig.stop), detokenize=True, include_stop_str_in_output=True, skip_special_tokens=False
            )
        return sp

    def generate(self, rid: str, input_ids: list[int], gconfig: GenerationConfig, max_new_tokens: int) -> HttpCall:
        body: dict[str, Any] = {
            "request_id": rid,
            "token_ids": list(input_ids),
            "sampling_params": self.sampling_params(gconfig, max_new_tokens),
            "output_mode": "tokens",
        }
        if gconfig.adapter is not None:
            # vLLM selects a loaded LoRA adapter by its name in "model".
            body["model"] = gconfig.adapter
        return HttpCall("POST", "/inference/v1/generate", body)

    def parse_generate(self, data: Any) -> GenerateChunk:
        try:
            choice = data["choices"][0]
            reason = _FINISH[choice.get("finish_reason") or "stop"]
            ids = [int(x) for x in (choice.get("token_ids") or [])]
            content = (choice.get("logprobs") or {}).get("content") or []
            lps = [float(c["logprob"]) for c in content]
            lp_ids = [int(c["token_id"]) for c in content]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ServerError(
                f"vLLM answered /inference/v1/generate with an unexpected body ({e}): {str(data)[:300]}"
            ) from None
        if len(ids) != len(lps):
            raise ServerError(f"vLLM returned {len(ids)} tokens but {len(lps)} logprobs (was logprobs requested?)")
        if lp_ids != ids:
            raise ServerError("vLLM logprob entries do not match the returned token ids")
        versions = self.token_versions(choice.get("weight_versions"), len(ids))
        # The kernel client stamps one version per chunk; after an abort-mode
        # pause every chunk comes from one version. A chunk spanning a version
        # change (keep-mode pause) carries its per-token versions in extra.
        known = [v for v in versions if v is not None]
        version = known[-1] if known else None
        extra = {"versions": versions} if len(set(versions)) > 1 else {}
        # vLLM's stop_reason: the matched stop string (or a stop token id).
        matched = choice.get("stop_reason")
        return GenerateChunk(
            ids, lps, reason, version=version, extra=extra, matched_stop=matched if isinstance(matched, str) else None
        )

    @staticmethod
    def token_versions(spans: Any, n: int) -> list[int | None]:
        """Per-token versions from vLLM's ``weight_versions`` spans ``[{version, start, end}]``."""
        out: list[int | None] = [None] * n
        for s in spans or []:
            v = parse_version(s.get("version"))
            for i in range(max(0, int(s["start"])), min(n, int(s["end"]))):
                out[i] = v
        return out

    # -- pause / resume ------------------------------------------------------------
    def pause(self, mode: str = "abort") -> HttpCall:
        if mode not in PAUSE_MODES:
            raise ServerError(f"pause mode {mode!r} is not valid; valid: {', '.join(PAUSE_MODES)}")
        return HttpCall("POST", f"/pause?mode={mode}", {})

    def resume(self) -> HttpCall:
        return HttpCall("POST", "/resume", {})

    # -- weights ---------------------------------------------------------------------
    def set_version(self, version: int) -> HttpCall:
        return HttpCall("POST", "/update_weight_version", {"new_version": str(version)})

    def update_weights_from_disk(self, path: str, version: int) -> ControlOp:
        return [
            HttpCall(
                "POST",
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": path, "is_checkpoint_format": True}},
                timeout_s=_LOAD_TIMEOUT_S,
            ),
            # A tied LM head and MoE experts keep stale prepacked weights after
            # a reload on CPU; our worker extension rebuilds them (see
            # areal_vllm.transfer.refresh_after_reload).
            HttpCall("POST", "/collective_rpc", {"method": "areal_refresh_after_reload"}),
            HttpCall("POST", "/reset_prefix_cache", {}),
            self.set_version(version),
        ]

    def load_adapter(self, name: str, path: str, version: int, replace: bool) -> ControlOp:
        """vLLM's runtime LoRA route (the server runs with
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); a replacement loads in place
        under the same adapter id from a new directory, then the prefix cache
        (computed with the old adapter) is dropped and the version labelled."""
        return [
            HttpCall(
                "POST",
                "/v1/load_lora_adapter",
                {"lora_name": name, "lora_path": path, "load_inplace": replace},
                timeout_s=_LOAD_TIMEOUT_S,
                parse=text_reply,
            ),
            HttpCall("POST", "/reset_prefix_cache", {}),
            self.set_version(version),
        ]

    def unload_adapter(self, name: str) -> HttpCall:
        return HttpCall("POST", "/v1/unload_lora_adapter", {"lora_name": name}, parse=text_reply)

    def init_weight_group(
        self, master_addr: str, master_port: int, world_size: int, rank: int, group_name: str, backend: str
    ) -> HttpCall:
        # ``rank`` is the first rank of this server; its tp workers take rank..rank+tp-1.
        return HttpCall(
            "POST",
            "/init_weight_transfer_engine",
            {"init_info": {"master_addr": master_addr, "master_port": master_port, "world_size": world_size,
                           "rank_offset": rank, "group_name": group_name, "backend": backend}},
            timeout_s=_LOAD_TIMEOUT_S,
        )  # fmt: skip

    def update_weights_from_distributed(
        self, tensors: list[dict[str, Any]], version: int, bucket_bytes: int, group_name: str
    ) -> ControlOp:
        return [
            HttpCall("POST", "/start_weight_update", {}),
            HttpCall(
                "POST",
                "/update_weights",
                {"update_info": {"tensors": tensors, "bucket_bytes": bucket_bytes}},
                timeout_s=_LOAD_TIMEOUT_S,
            ),
            HttpCall("POST", "/finish_weight_update", {"weight_version": str(version)}, timeout_s=_LOAD_TIMEOUT_S),
            HttpCall("POST", "/reset_prefix_cache", {}),
        ]

    # -- weight-delivery check ------------------------------------------------------
    def weight_fingerprint(self, spec: dict[str, Any]) -> list[HttpCall]:
        """Our worker extension's ``areal_weight_fingerprint`` through
        ``/collective_rpc`` (see ``areal_vllm.fingerprint``), then
        ``/weight_info`` for the version the server labels its weights with;
        the last call's parse returns both in one reply."""
        if self.tp_size > 1:
            raise NotImplementedError(
                f"the vLLM fingerprint covers tensor-parallel size 1 (these servers run {self.tp_size} shards)"
            )
        if self.image_placeholders is not None:
            # vLLM names a vision-language model's towers its own way per model class; unmapped.
            raise NotImplementedError("the vLLM fingerprint maps text models' tensor names only")
        acc: dict[str, Any] = {}
        adapter = spec.get("adapter")
        if adapter is not None:
            # Workers know adapters by vLLM's integer id only; /v1/models
            # lists the names in the order those ids were given out.
            return [
                HttpCall("GET", "/v1/models", parse=lambda raw: _adapter_names(acc, raw)),
                HttpCall(
                    "POST",
                    "/collective_rpc",
                    {"method": "areal_adapter_fingerprints", "args": [json.dumps(spec)]},
                    timeout_s=_LOAD_TIMEOUT_S,
                    parse=lambda raw: _pick_adapter(acc, adapter, raw),
                ),
                HttpCall("GET", "/weight_info", parse=lambda raw: _with_version(acc, raw)),
            ]
        return [
            HttpCall(
                "POST",
                "/collective_rpc",
                {"method": "areal_weight_fingerprint", "args": [json.dumps(spec)]},
                timeout_s=_LOAD_TIMEOUT_S,
                parse=lambda raw: _worker_reply(acc, raw),
            ),
            HttpCall("GET", "/weight_info", parse=lambda raw: _with_version(acc, raw)),
        ]


def _worker_reply(acc: dict[str, Any], raw: bytes) -> dict[str, Any]:
    """The one worker's fingerprint from a ``/collective_rpc`` reply
    (``{"results": [reply per worker]}``), kept in ``acc``."""
    data = json.loads(raw) if raw else None
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list) or len(results) != 1 or not isinstance(results[0], dict):
        raise ServerError(f"vLLM /collective_rpc areal_weight_fingerprint: unexpected reply {str(data)[:300]}")
    acc.clear()
    acc.update(results[0])
    return acc


def _adapter_names(acc: dict[str, Any], raw: bytes) -> dict[str, Any]:
    """The LoRA adapters a vLLM server serves, in ``/v1/models`` order (its
    cards with a ``parent``: the base model's own card has none)."""
    data = json.loads(raw) if raw else None
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        raise ServerError(f"vLLM /v1/models: unexpected reply {str(data)[:300]}")
    acc["adapter_names"] = [c.get("id") for c in cards if isinstance(c, dict) and c.get("parent")]
    return acc


def _pick_adapter(acc: dict[str, Any], adapter: str, raw: bytes) -> dict[str, Any]:
    """The fingerprint of ``adapter`` among the worker's per-id replies.

    vLLM gives each new adapter name the next integer id, keeps the id when
    an adapter is replaced in place, and lists names in ``/v1/models`` in
    the order they were first loaded (unloaded names leave both), so the
    k-th listed name is the k-th smallest id the worker holds, as long as the
    worker holds each listed adapter once. When the counts differ (the
    worker's adapter cache evicted one) the server is reported as not
    answering rather than compared against a guess."""
    data = json.loads(raw) if raw else None
    results = data.get("results") if isinstance(data, dict) else None
    one = results[0] if isinstance(results, list) and len(results) == 1 else None
    replies = one.get("adapters") if isinstance(one, dict) else None
    if not isinstance(replies, dict):
        raise ServerError(f"vLLM /collective_rpc areal_adapter_fingerprints: unexpected reply {str(data)[:300]}")
    names = acc.get("adapter_names") or []
    if adapter not in names:
        acc.clear()
        acc.update({"version": None, "tensors": {}, "missing": []})  # every sampled tensor: absent
        return acc
    ids = sorted(replies, key=int)
    if len(ids) != len(names):
        raise ServerError(
            f"vLLM lists {len(names)} adapter(s) but its worker holds {len(ids)}: cannot tell which is {adapter!r}"
        )
    acc.clear()
    acc.update(replies[ids[names.index(adapter)]])
    return acc


def _with_version(acc: dict[str, Any], raw: bytes) -> dict[str, Any]:
    data = json.loads(raw) if raw else None
    acc["version"] = parse_version(data.get("weight_version")) if isinstance(data, dict) else None
    return acc


class VLLMInferenceEngine(RemoteInferenceEngine):
    """The kernel's remote client; versions are also labelled on the servers
    (vLLM reports them per token in ``weight_versions``)."""

    protocol: VLLMProtocol

    def set_version(self, version: int) -> None:
        """Record ``version`` here *and* label the servers' weights with it, so
        tokens generated from now on carry it in ``weight_versions``."""
        self.control_all(self.protocol.set_version(version))
        super().set_version(version)

    def server_versions(self) -> list[int | None]:
        """Each server's current weight version (``GET /weight_info``)."""
        call = HttpCall("GET", "/weight_info")
        return [parse_version(self.control(s.address, call).get("weight_version")) for s in self.servers]
