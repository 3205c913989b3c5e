"""SGLang's native HTTP API as the kernel's generic client sees it.

Bodies follow the request classes of ``sglang.srt.managers.io_struct`` (the
tests check every body below against the classes of the pinned release).
SGLang carries weight versions as strings; the kernel counts them as ints,
so versions travel as ``str(int)`` and come back through ``int()``.
"""

from __future__ import annotations

import os
from typing import Any

from areal_kernel.api.io import GenerationConfig, StopReason
from areal_kernel.errors import ServerError
from areal_kernel.inference.wire import GenerateChunk, HttpCall, ServerProtocol, text_reply

_FINISH = {"stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORT}
PAUSE_MODES = ("abort", "retract", "in_place")
# Loading weights can take minutes on big models: never the generation timeout.
WEIGHT_CALL_TIMEOUT_S = 1800.0


def _version_str(version: int) -> str:
    return str(int(version))


def parse_version(raw: Any) -> int | None:
    """SGLang's ``weight_version`` ("default" until someone sets one) as an int, or None."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lstrip("-").isdigit():
        return int(raw)
    return None


def sampling_params(gconfig: GenerationConfig, max_new_tokens: int) -> dict[str, Any]:
    """SGLang ``SamplingParams`` keys. Greedy is temperature 0 in SGLang; top_k -1 disables."""
    sp: dict[str, Any] = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": 0.0 if gconfig.greedy else float(gconfig.temperature),
        "top_p": float(gconfig.top_p),
        "top_k": int(gconfig.top_k) if gconfig.top_k and gconfig.top_k > 0 else -1,
        "stop_token_ids": [int(t) for t in gconfig.stop_token_ids],
        # The kernel decides about stopping from token ids; no text-level trimming.
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if gconfig.stop:
        # Matched on the decoded text; output_ids keep every sampled token.
        sp["stop"] = list(gconfig.stop)
    return sp


# SGLang's --dtype values -> torch dtype names ("auto": the model's own; unknown here).
_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "float32": "float32"}


class SGLangProtocol(ServerProtocol):
    health_path = "/health"
    # /get_weights_by_name answers a tensor's leading rows (as float32 lists):
    # the weight-delivery check samples among the first 64 elements, which
    # one row of every 2-D weight holds.
    fingerprint_prefix = 64

    def __init__(self, pause_mode: str = "abort", tp_size: int = 1, dtype: str | None = None) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ServerError(f"pause mode {pause_mode!r} is not one of SGLang's: {', '.join(PAUSE_MODES)}")
        self.pause_mode = pause_mode
        # Every TP rank of a server joins the weight group: server i owns ranks 1 + i*tp .. (i+1)*tp.
        self.tp_size = tp_size
        # The dtype the server holds weights in (its --dtype): /get_weights_by_name
        # answers float32, which holds every bfloat16/float16 value exactly, so
        # casting back gives the bits the server holds.
        self.dtype = _DTYPES.get(dtype or "", None)

    @property
    def ranks_per_server(self) -> int:  # type: ignore[override]
        return max(1, self.tp_size)

    # -- generation ----------------------------------------------------------
    def generate(self, rid: str, input_ids: list[int], gconfig: GenerationConfig, max_new_tokens: int) -> HttpCall:
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": sampling_params(gconfig, max_new_tokens),
            "return_logprob": True,
            "stream": False,
        }
        if gconfig.adapter is not None:
            # SGLang selects a loaded adapter by its name in lora_path.
            body["lora_path"] = gconfig.adapter
        return HttpCall("POST", "/generate", body)

    def parse_generate(self, data: Any) -> GenerateChunk:
        try:
            if isinstance(data, list):  # a batch answer; we only ever send one prompt
                (data,) = data
            meta = data["meta_info"]
            ids = [int(x) for x in data["output_ids"]]
            entries = meta["output_token_logprobs"] or []
            lps = [float(e[0]) for e in entries]
            lp_ids = [int(e[1]) for e in entries]
            fr = meta["finish_reason"]
            kind = fr["type"] if isinstance(fr, dict) else fr
            reason = _FINISH[kind]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ServerError(
                f"SGLang answered /generate with an unexpected body ({type(e).__name__}: {e}): {str(data)[:300]}"
            ) from None
        if lp_ids != ids:
            raise ServerError(
                f"SGLang's output_token_logprobs do not match output_ids ({len(lp_ids)} vs {len(ids)} tokens); "
                "was the request sent with return_logprob?"
            )
        extra = {"finish_reason": fr}
        if isinstance(fr, dict) and reason == StopReason.STOP and fr.get("matched") is not None:
            extra["matched"] = fr["matched"]
        matched = extra.get("matched")
        return GenerateChunk(
            ids,
            lps,
            reason,
            version=parse_version(meta.get("weight_version")),
            extra=extra,
            matched_stop=matched if isinstance(matched, str) else None,
        )

    # -- pause / resume ------------------------------------------------------
    def pause(self, mode: str | None = None) -> HttpCall:
        """The kernel's client always asks for "abort"; the configured mode
        (rollout.sglang.pause_mode) applies then, an explicit other mode wins."""
        if mode is None or mode == "abort":
            mode = self.pause_mode
        if mode not in PAUSE_MODES:
            raise ServerError(f"pause mode {mode!r} is not one of SGLang's: {', '.join(PAUSE_MODES)}")
        return HttpCall("POST", "/pause_generation", {"mode": mode})

    def resume(self) -> HttpCall:
        return HttpCall("POST", "/continue_generation", {})

    # -- weights -------------------------------------------------------------
    def update_weights_from_disk(self, path: str, version: int) -> HttpCall:
        return HttpCall(
            "POST",
            "/update_weights_from_disk",
            {
                "model_path": path,
                "weight_version": _version_str(version),
                "flush_cache": True,
                "abort_all_requests": False,
            },
            timeout_s=WEIGHT_CALL_TIMEOUT_S,
        )

    def init_weight_group(
        self, master_addr: str, master_port: int, world_size: int, rank: int, group_name: str, backend: str
    ) -> HttpCall:
        # SGLang's rank_offset: this server's TP ranks are rank_offset .. rank_offset + tp - 1.
        return HttpCall(
            "POST",
            "/init_weights_update_group",
            {
                "master_address": master_addr,
                "master_port": int(master_port),
                "rank_offset": int(rank),
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            },
            timeout_s=WEIGHT_CALL_TIMEOUT_S,
        )

    def update_weights_from_distributed(
        self, tensors: list[dict[str, Any]], version: int, bucket_bytes: int, group_name: str
    ) -> HttpCall:
        # SGLang receives one broadcast per listed tensor, in this order.
        return HttpCall(
            "POST",
            "/update_weights_from_distributed",
            {
                "names": [t["name"] for t in tensors],
                "dtypes": [str(t["dtype"]) for t in tensors],
                "shapes": [[int(x) for x in t["shape"]] for t in tensors],
                "group_name": group_name,
                "weight_version": _version_str(version),
                "flush_cache": True,
            },
            timeout_s=WEIGHT_CALL_TIMEOUT_S,
        )

    def update_weights_bucket(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, version: int | None
    ) -> HttpCall:
        """One dense bucket (``load_format: flattened_bucket``): SGLang allocates
        ``FlattenedTensorBucket.empty(names, dtypes, shapes)`` and receives it with
        one broadcast. Only the last bucket of an update carries the version and
        flushes the cache (the flush is refused while requests still run)."""
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": [str(d) for d in dtypes],
            "shapes": [[int(x) for x in s] for s in shapes],
            "group_name": group_name,
            "load_format": "flattened_bucket",
            "flush_cache": version is not None,
        }
        if version is not None:
            body["weight_version"] = _version_str(version)
        return HttpCall("POST", "/update_weights_from_distributed", body, timeout_s=WEIGHT_CALL_TIMEOUT_S)

    def begin_weight_update(self) -> HttpCall:
        # SGLang 0.5.23 refuses /update_weights_from_distributed outside such a session.
        return HttpCall("POST", "/begin_weight_update", {}, timeout_s=WEIGHT_CALL_TIMEOUT_S)

    def end_weight_update(self) -> HttpCall:
        return HttpCall("POST", "/end_weight_update", {}, timeout_s=WEIGHT_CALL_TIMEOUT_S)

    def destroy_weight_group(self, group_name: str) -> HttpCall:
        return HttpCall("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def set_version(self, version: int) -> HttpCall:
        return HttpCall(
            "POST", "/update_weight_version", {"new_version": _version_str(version), "abort_all_requests": False}
        )

    # -- weight-delivery check ------------------------------------------------------
    def weight_fingerprint(self, spec: dict[str, Any]) -> list[HttpCall]:
        """One ``/get_weights_by_name`` per tensor (SGLang's route; the name
        is the HF name, ``truncate_size`` the leading rows to return), the
        fingerprint computed here from the values: the sampled positions lie
        in the first ``fingerprint_prefix`` elements. The last call's parse
        returns the whole fingerprint (``areal_kernel.monitor.weights.fingerprint``'s shape).

        An adapter: SGLang has no route that reads an adapter's weights, but
        ``GET /v1/models`` lists every loaded adapter (``id``: its name,
        ``root``: the path it was loaded from). The client passes the
        directories it told the servers to load (``spec["adapter_dirs"]``,
        path -> version); the reply is the version whose directory the server
        serves, ``version_only`` (no bytes compared)."""
        if spec.get("adapter") is not None:
            dirs = spec.get("adapter_dirs")
            if not dirs:
                # In memory (load_lora_adapter_from_tensors; not used by this
                # plugin) SGLang lists every adapter's root as "__tensor__".
                raise NotImplementedError(
                    f"SGLang reports only the directory an adapter was loaded from, and adapter {spec['adapter']!r} "
                    "was not loaded from one"
                )
            return [HttpCall("GET", "/v1/models", None, parse=_AdapterServed(spec["adapter"], dirs))]
        if self.dtype is None:
            raise NotImplementedError(
                "the SGLang servers' dtype is 'auto' (set rollout.sglang.dtype or model.dtype to compare weights)"
            )
        acc: dict[str, Any] = {"version": None, "tensors": {}, "missing": []}
        calls = []
        for t in spec["tensors"]:
            shape = t.get("shape") or []
            row = 1
            for x in shape[1:]:
                row *= int(x)
            rows = max(t["positions"], default=0) // max(row, 1) + 1
            calls.append(
                HttpCall(
                    "POST",
                    "/get_weights_by_name",
                    {"name": t["name"], "truncate_size": int(rows)},
                    parse=_FingerprintPart(acc, t["name"], t["positions"], shape, self.dtype),
                )
            )
        return calls

    # -- LoRA adapters ------------------------------------------------------------
    def load_adapter(self, name: str, path: str, version: int, replace: bool) -> list[HttpCall]:
        """SGLang loads an adapter under a new name only: a replacement is
        unload + load (the new load gets a fresh adapter id, so cached prefixes
        of the old one are not reused), then the version is labelled."""
        calls = [self.unload_adapter(name)] if replace else []
        calls.append(
            HttpCall(
                "POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout_s=WEIGHT_CALL_TIMEOUT_S
            )
        )
        return calls + [self.set_version(version)]

    def unload_adapter(self, name: str) -> HttpCall:
        return HttpCall("POST", "/unload_lora_adapter", {"lora_name": name})

    # -- SGLang-only control calls ----------------------------------------------
    def flush_cache(self) -> HttpCall:
        # No body; the answer is plain text ("Cache flushed."), not JSON.
        return HttpCall("POST", "/flush_cache", None, parse=text_reply)

    def abort_request(self, rid: str | None = None) -> HttpCall:
        body: dict[str, Any] = {"abort_all": True} if rid is None else {"rid": rid, "abort_all": False}
        return HttpCall("POST", "/abort_request", body)

    def release_memory(self, tags: list[str] | None = None) -> HttpCall:
        return HttpCall(
            "POST", "/release_memory_occupation", {"tags": list(tags)} if tags else {}, timeout_s=WEIGHT_CALL_TIMEOUT_S
        )

    def resume_memory(self, tags: list[str] | None = None) -> HttpCall:
        return HttpCall(
            "POST", "/resume_memory_occupation", {"tags": list(tags)} if tags else {}, timeout_s=WEIGHT_CALL_TIMEOUT_S
        )


class _AdapterServed:
    """Parses SGLang's ``/v1/models`` (an OpenAI model list: the base model,
    then one card per loaded adapter with ``root`` = its ``lora_path``) into a
    ``version_only`` fingerprint of adapter ``name``: the version whose
    directory (``dirs``: path -> version) the server serves, or null."""

    def __init__(self, name: str, dirs: dict[str, int]) -> None:
        self.name = name
        # Normalised, so "dir/" and "dir" are one directory.
        self.dirs = {os.path.normpath(p): int(v) for p, v in dirs.items()}

    def __call__(self, raw: bytes) -> dict[str, Any]:
        import json

        data = json.loads(raw)
        cards = data.get("data") if isinstance(data, dict) else None
        if not isinstance(cards, list):
            raise ValueError("/v1/models answered without a 'data' list")
        # Adapter cards name the base model as their parent; the base card has none.
        roots = [c.get("root") for c in cards if isinstance(c, dict) and c.get("id") == self.name and c.get("parent")]
        no_bytes = "SGLang cannot read an adapter's weights back, so the directory it loaded is compared"
        if not roots or not isinstance(roots[0], str):
            return {"version": None, "tensors": {}, "version_only": f"it serves no adapter {self.name!r}; {no_bytes}"}
        version = self.dirs.get(os.path.normpath(roots[0]))
        return {
            "version": version,
            "tensors": {},
            "version_only": f"it serves adapter {self.name!r} from {roots[0]!r}; {no_bytes}",
        }


class _FingerprintPart:
    """Parses one ``/get_weights_by_name`` reply into the running fingerprint
    ``acc`` (and returns it): the leading rows as nested float lists, or null
    when SGLang has no such parameter."""

    def __init__(self, acc: dict[str, Any], name: str, positions: list[int], shape: list[int], dtype: str) -> None:
        self.acc, self.name, self.positions, self.shape, self.dtype = acc, name, positions, shape, dtype

    def __call__(self, raw: bytes) -> dict[str, Any]:
        import json

        import torch

        from areal_kernel.monitor.weights import checksum

        data = json.loads(raw) if raw else None
        if data is None:
            self.acc["missing"].append(self.name)
            return self.acc
        flat = torch.tensor(data, dtype=torch.float32).reshape(-1)
        numel = 1
        for x in self.shape:
            numel *= int(x)
        if any(p >= flat.numel() for p in self.positions):
            raise ValueError(f"/get_weights_by_name returned {flat.numel()} values of {self.name!r}, fewer than asked")
        values = flat[torch.tensor(self.positions, dtype=torch.long)].to(getattr(torch, self.dtype))
        self.acc["tensors"][self.name] = checksum(values, numel)
        return self.acc
