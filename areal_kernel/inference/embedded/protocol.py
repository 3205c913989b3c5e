"""Request bodies of the embedded server, parsed and validated (no torch).

Every problem raises ``RequestError`` naming the field; the server turns it
into HTTP 400 ``{"error": ...}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_kernel.api.io import ImageInputs
from areal_kernel.errors import ArealError


class RequestError(ArealError):
    """A request body is invalid (HTTP 400)."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: disabled
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # see GenerationConfig.seed
    stop: list[str] = field(default_factory=list)  # see GenerationConfig.stop


@dataclass
class GenerateBody:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    # The prompt's images (vision-language models): encoded files, decoded by the server.
    images: ImageInputs | None = None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _require_dict(body: Any, what: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"{what}: body must be a JSON object, got {type(body).__name__}")
    return body


def parse_sampling(sp: Any) -> SamplingParams:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise RequestError("sampling_params must be a JSON object")
    known = {"max_new_tokens", "temperature", "top_p", "top_k", "greedy", "stop_token_ids", "seed", "stop"}
    unknown = sorted(set(sp) - known)
    if unknown:
        raise RequestError(f"sampling_params: unknown field(s) {unknown}; valid: {sorted(known)}")
    out = SamplingParams()
    if "max_new_tokens" in sp:
        v = sp["max_new_tokens"]
        if not _is_int(v) or v < 1:
            raise RequestError(f"sampling_params.max_new_tokens must be an integer >= 1, got {v!r}")
        out.max_new_tokens = v
    if "temperature" in sp:
        v = sp["temperature"]
        if not _is_num(v) or v < 0 or v != v:
            raise RequestError(f"sampling_params.temperature must be a number >= 0, got {v!r}")
        out.temperature = float(v)
    if "top_p" in sp:
        v = sp["top_p"]
        if not _is_num(v) or not 0 < v <= 1:
            raise RequestError(f"sampling_params.top_p must be a number in (0, 1], got {v!r}")
        out.top_p = float(v)
    if "top_k" in sp:
        v = sp["top_k"]
        if not _is_int(v) or v < -1:
            raise RequestError(f"sampling_params.top_k must be an integer >= -1 (-1 or 0: disabled), got {v!r}")
        out.top_k = v
    if "greedy" in sp:
        v = sp["greedy"]
        if not isinstance(v, bool):
            raise RequestError(f"sampling_params.greedy must be true or false, got {v!r}")
        out.greedy = v
    if "stop_token_ids" in sp:
        v = sp["stop_token_ids"]
        if v is None:
            v = []
        if not isinstance(v, list) or not all(_is_int(x) and x >= 0 for x in v):
            raise RequestError(f"sampling_params.stop_token_ids must be a list of token ids (ints >= 0), got {v!r}")
        out.stop_token_ids = list(v)
    if sp.get("seed") is not None:
        v = sp["seed"]
        if not _is_int(v) or not 0 <= v < 2**63:
            raise RequestError(f"sampling_params.seed must be an integer in [0, 2**63) or null, got {v!r}")
        out.seed = v
    if sp.get("stop") is not None:
        v = sp["stop"]
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise RequestError(f"sampling_params.stop must be a list of non-empty strings, got {v!r}")
        out.stop = list(v)
    # temperature 0 means greedy (the usual convention of vLLM/SGLang).
    if out.temperature == 0:
        out.greedy = True
    return out


def parse_generate(body: Any, vocab_size: int, max_positions: int) -> GenerateBody:
    body = _require_dict(body, "/generate")
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise RequestError(f"rid must be a non-empty string, got {rid!r}")
    ids = body.get("input_ids")
    if ids is None:
        raise RequestError("input_ids is missing: give the prompt as a list of token ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(x) for x in ids):
        raise RequestError("input_ids must be a non-empty list of integer token ids")
    bad = [x for x in ids if not 0 <= x < vocab_size]
    if bad:
        raise RequestError(f"input_ids holds id(s) outside [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_positions:
        raise RequestError(
            f"input_ids has {len(ids)} tokens; the model's context is {max_positions} (prompt must be shorter)"
        )
    adapter = body.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise RequestError(f"adapter must be a non-empty string (a loaded adapter's name) or null, got {adapter!r}")
    images = body.get("images")
    parsed_images: ImageInputs | None = None
    if images is not None:
        if not isinstance(images, list) or not images or not all(isinstance(x, str) and x for x in images):
            raise RequestError("images must be a non-empty list of base64-encoded image files, or null")
        try:
            parsed_images = ImageInputs.from_b64(images)
        except (ValueError, TypeError) as e:
            raise RequestError(f"images: not valid base64 ({e})") from None
    return GenerateBody(
        rid=rid,
        input_ids=list(ids),
        params=parse_sampling(body.get("sampling_params")),
        adapter=adapter,
        images=parsed_images,
    )


def get_int(body: Any, name: str, what: str, minimum: int | None = None) -> int:
    body = _require_dict(body, what)
    v = body.get(name)
    if not _is_int(v) or (minimum is not None and v < minimum):
        lo = f" >= {minimum}" if minimum is not None else ""
        raise RequestError(f"{what}: field {name!r} must be an integer{lo}, got {v!r}")
    return v


def get_str(body: Any, name: str, what: str, default: str | None = None) -> str:
    body = _require_dict(body, what)
    v = body.get(name, default)
    if not isinstance(v, str) or not v:
        raise RequestError(f"{what}: field {name!r} must be a non-empty string, got {v!r}")
    return v


def parse_tensor_meta(body: Any, what: str) -> list[dict]:
    body = _require_dict(body, what)
    metas = body.get("tensors")
    if not isinstance(metas, list) or not metas:
        raise RequestError(f"{what}: field 'tensors' must be a non-empty list of {{name, dtype, shape}}")
    out = []
    for i, m in enumerate(metas):
        if not isinstance(m, dict):
            raise RequestError(f"{what}: tensors[{i}] must be an object with name, dtype, shape")
        name, dtype, shape = m.get("name"), m.get("dtype"), m.get("shape")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{what}: tensors[{i}].name must be a non-empty string")
        if not isinstance(dtype, str):
            raise RequestError(f"{what}: tensors[{i}].dtype must be a string like 'bfloat16'")
        if not isinstance(shape, list) or not all(_is_int(x) and x >= 0 for x in shape):
            raise RequestError(f"{what}: tensors[{i}].shape must be a list of non-negative ints")
        out.append({"name": name, "dtype": dtype, "shape": list(shape)})
    return out
