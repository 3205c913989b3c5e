"""Chat messages -> prompt token ids, token-exact across turns.

The first request of a conversation is rendered with the tokenizer's chat
template and tokenised. A later request whose messages extend an earlier
request's messages plus the answer the proxy gave is *not* re-tokenised:
its prompt is the earlier prompt, the exact tokens the model generated, and
only the template's text for the new messages tokenised and appended.
Re-tokenising decoded model output can give other ids than the model
produced (BPE merges across the boundary, non-canonical splits); training
on such a prompt would score tokens the policy never sampled.

How the delta is found without knowing the template: render the earlier
messages plus an assistant message holding only a sentinel. What follows the
sentinel up to the end is the template's closing of an assistant turn (for
ChatML ``<|im_end|>\\n``); what the full rendering adds after that is the
new messages and the next generation prompt. The model's own stop token
stands for the start of that closing. When the template does not render
prefix-stably (the earlier conversation renders differently once more
messages follow), there is no exact continuation and the request starts a
new token sequence.
"""

from __future__ import annotations

import json
from typing import Any

from areal_kernel.errors import DataError

_SENTINEL = "\u2063AREAL-ASSISTANT-SENTINEL\u2063"
ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(content: Any, where: str) -> str:
    """OpenAI message content (a string, ``None`` or a list of text parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise DataError(f"{where}.content[{i}]: only text parts are supported, got {kind!r}")
            out.append(part["text"])
        return "".join(out)
    raise DataError(f"{where}.content: expected a string, null or a list of text parts")


def _arguments(value: Any) -> Any:
    """Tool-call arguments compared by meaning: JSON text and the object it encodes are equal."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def tool_calls_key(calls: Any) -> tuple:
    out = []
    for c in calls or ():
        fn = (c or {}).get("function") or {}
        out.append((fn.get("name"), json.dumps(_arguments(fn.get("arguments")), sort_keys=True)))
    return tuple(out)


def message_key(msg: dict[str, Any]) -> tuple:
    """What makes two messages the same message (ids of tool calls and
    whitespace around content are ignored: clients rewrite both)."""
    return (
        msg.get("role"),
        message_text(msg.get("content"), "message").strip(),
        tool_calls_key(msg.get("tool_calls")),
        msg.get("tool_call_id") or "",
        msg.get("name") or "",
    )


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text content, never ``None``;
    ``developer`` is the newer name of ``system``."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"messages[{i}].role: expected one of {', '.join(ROLES)}, got {role!r}")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = message_text(m.get("content"), f"messages[{i}]")
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict((c or {}).get("function") or {})
                # Templates index arguments as a mapping (``arguments.items()``).
                fn["arguments"] = _arguments(fn.get("arguments"))
                calls.append({**c, "function": fn})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


class ChatTokenizer:
    """Renders and tokenises conversations with one HF tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if tools:
            kwargs["tools"] = tools
        return str(self.tok.apply_chat_template(for_template(messages), **kwargs))

    def encode(self, text: str) -> list[int]:
        # The template writes every special token itself.
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The tokens of a conversation's first request."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def continuation(
        self,
        earlier: list[dict[str, Any]],
        new: list[dict[str, Any]],
        tools: list[dict] | None,
        output_ids: list[int],
        stopped_on_token: bool,
    ) -> list[int] | None:
        """The tokens to append after an earlier request's prompt and the
        ``output_ids`` the model answered it with, so that the result is the
        prompt of ``earlier + [that answer] + new``. ``None`` when the
        template cannot be continued exactly (then render from scratch).
        ``stopped_on_token``: the output ends with a stop token (the model
        closed its turn itself)."""
        if not new:
            return None
        sentinel = {"role": "assistant", "content": _SENTINEL}
        try:
            head = self.render(earlier, tools, add_generation_prompt=True)
            closed = self.render([*earlier, sentinel], tools, add_generation_prompt=False)
            full = self.render([*earlier, sentinel, *new], tools, add_generation_prompt=True)
        except Exception:  # a template that rejects the sentinel shape: no exact continuation
            return None
        at = closed.find(_SENTINEL)
        if at != len(head) or not closed.startswith(head) or not full.startswith(closed):
            return None
        closing = closed[at + len(_SENTINEL) :]
        if stopped_on_token and output_ids:
            stop_text = self.decode(output_ids[-1:], skip_special_tokens=False)
            if stop_text and closing.startswith(stop_text):
                closing = closing[len(stop_text) :]
        return self.encode(closing + full[len(closed) :])
