"""The OpenAI chat-completions wire format, as far as the proxy speaks it:
request validation, response and stream-chunk bodies, error bodies.

The shapes both OpenAI-compatible servers of the kernel answer in (this
proxy and the ``areal inf`` gateway, ``services.inf.openai_api``) live here
once: ``error_body``, ``sse``, ``usage``, ``token_logprobs``."""

from __future__ import annotations

import json
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from areal_kernel.agent.sessions import SessionError


# The message roles of OpenAI's chat API; a template may render any string,
# so an unknown one (a typo) is refused rather than rendered as a speaker.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def unknown_role(role: Any) -> str | None:
    """Why ``role`` is not a chat role, or ``None`` when it is one."""
    if not isinstance(role, str):
        return "every message needs a string 'role'"
    if role not in CHAT_ROLES:
        return f"{role!r} is not a chat role; expected one of {', '.join(CHAT_ROLES)}"
    return None


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions``. Fields clients send that change nothing
    here (``user``, ``metadata``, ``store``, ``parallel_tool_calls``, ...)
    are accepted and ignored; fields whose meaning the proxy cannot honour
    are refused with an error naming them (``check_supported``)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise SessionError(400, "the request body must be a JSON object", "invalid_request")
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        raise SessionError(400, f"field '{loc}': {err['msg']}", "invalid_request", loc) from None
    check_supported(req)
    return req


def check_supported(req: ChatRequest) -> None:
    def refuse(param: str, why: str) -> None:
        raise SessionError(400, f"field '{param}': {why}", "unsupported_parameter", param)

    if req.stop:
        refuse("stop", "stop strings are not supported by this proxy (the model stops at its end-of-turn token)")
    if req.presence_penalty or req.frequency_penalty:
        refuse("presence_penalty" if req.presence_penalty else "frequency_penalty", "penalties are not supported")
    if req.logit_bias:
        refuse("logit_bias", "logit biases are not supported")
    if req.top_logprobs:
        refuse("top_logprobs", "only the sampled token's logprob is available (top_logprobs: 0)")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        refuse("response_format", "only the 'text' response format is supported")
    if req.tool_choice not in (None, "auto", "none"):
        refuse("tool_choice", "only 'auto' and 'none' are supported (a call cannot be forced)")
    for i, m in enumerate(req.messages):
        why = unknown_role(m.get("role"))
        if why:
            refuse(f"messages.{i}.role", why)


def error_body(
    message: str, code: str | None, param: str | None = None, status: int = 400, kind: str | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``; ``type`` follows the status unless ``kind`` is given."""
    if kind is None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        if status in (401, 403):
            kind = "authentication_error" if status == 401 else "permission_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(data: Any) -> bytes:
    """One server-sent event: a JSON body, or a literal string such as ``[DONE]``."""
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()


def tool_call_json(call: Any, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:
        out["index"] = index
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_logprobs(decode: Callable[[list[int]], str], ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    """The ``logprobs.content`` entries of the sampled tokens (no alternatives: ``top_logprobs`` is empty)."""
    out = []
    for t, lp in zip(ids, logprobs):
        s = decode([t])
        out.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
    return out
