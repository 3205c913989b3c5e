"""OpenAI-compatible request bodies in, kernel generation requests out, and back.

The gateway turns ``/v1/chat/completions`` and ``/v1/completions`` bodies
into token ids (the model's own tokenizer and chat template), generates
through the backend's ``RemoteInferenceEngine`` and answers in OpenAI's
shapes (whole responses, or ``text/event-stream`` chunks). Parameters the
kernel's servers do not support (``tools`` output parsing, ``logit_bias``,
penalties, ``best_of``...) are accepted and ignored, as OpenAI-compatible
servers commonly do; a malformed value of a supported one is a 400 naming it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from areal_kernel.agent.openai_wire import error_body, unknown_role, usage

__all__ = ["OpenAIError", "Sampling", "parse_sampling", "usage"]  # usage: the proxy's, shared
MAX_N = 16


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type_: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.code, self.param, self.status, kind=self.type)


@dataclass
class Sampling:
    """The supported sampling parameters of one request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    greedy: bool = False
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise OpenAIError(400, f"'{key}' must be a number in [{lo:g}, {hi:g}], got {v!r}", param=key)
    return float(v)


def _integer(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise OpenAIError(400, f"'{key}' must be an integer {bound}, got {v!r}", param=key)
    return v


def parse_sampling(body: dict[str, Any], default_max_tokens: int, *, chat: bool) -> Sampling:
    max_tokens = _integer(body, "max_completion_tokens", None, 1) if chat else None
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", default_max_tokens, 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise OpenAIError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise OpenAIError(400, "'stream_options' must be an object", param="stream_options")
    if chat:
        lp = body.get("logprobs", False)
        if not isinstance(lp, bool):
            raise OpenAIError(400, f"'logprobs' must be true or false, got {lp!r}", param="logprobs")
        logprobs = lp
    else:
        logprobs = _integer(body, "logprobs", None, 0, 5) is not None
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise OpenAIError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
    top_k = _integer(body, "top_k", -1, -1)
    return Sampling(
        max_tokens=int(max_tokens or default_max_tokens),
        # temperature 0 means greedy decoding; the servers take greedy=True for it.
        temperature=temperature if temperature > 0 else 1.0,
        greedy=temperature == 0,
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=int(top_k if top_k is not None else -1),
        n=int(_integer(body, "n", 1, 1, MAX_N) or 1),
        seed=seed,
        stop=stops,
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        logprobs=logprobs,
    )


def _message_text(content: Any, i: int) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(400, f"messages[{i}].content: only text parts are supported, got {kind!r}")
        return "".join(parts)
    raise OpenAIError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")


def chat_prompt_ids(tokenizer: Any, body: dict[str, Any], model: str) -> list[int]:
    """The token ids of a chat: the model's chat template with the generation
    prompt, tokenised without adding special tokens again (the template has them)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "'messages' must be a non-empty list", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise OpenAIError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        why = unknown_role(m["role"])
        if why:
            raise OpenAIError(400, f"messages[{i}].role: {why}", param="messages")
        clean.append({**m, "content": _message_text(m.get("content"), i)})
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(
            400, f"model '{model}' has no chat template; use /v1/completions with a prompt", param="messages"
        )
    try:
        text = tokenizer.apply_chat_template(clean, tools=body.get("tools"), add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a template raising on the conversation (e.g. roles out of order)
        raise OpenAIError(400, f"the chat template of '{model}' rejected the messages: {e}", param="messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def completion_prompt_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError(400, "'prompt' is empty", param="prompt")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise OpenAIError(
        400, "'prompt' must be a string, a list of token ids, or a list with one of those", param="prompt"
    )


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class TextStream:
    """Turns the growing list of generated ids into text deltas, holding back
    what may still change: an incomplete UTF-8 sequence at the end, and a
    tail that could be the start of a stop string."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0

    def delta(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """The text to send now, and whether a stop string ended the output."""
        text, stopped = cut_at_stop(self.tokenizer.decode(ids, skip_special_tokens=True), self.stops)
        end = len(text)
        if not (final or stopped):
            end = len(text.rstrip("\ufffd")) - self.hold
        out = text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out, stopped


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
