"""Records -> token sequences for the offline trainers (SFT, DPO/IPO, RM).

SFT records are chat conversations (``messages``: ``[{role, content}, ...]``,
loss on assistant turns) or ``prompt`` + ``completion`` (``answer`` is accepted
in place of ``completion``, so the built-in arithmetic questions are SFT data).
Preference records are ``prompt`` + ``chosen`` + ``rejected``; each of them may
be a string or a list of chat messages. With ``dataset.type: arithmetic``,
pairs are built from each question: the correct answer is chosen, a wrong one
(off by 1 to 3, seeded) rejected.

A conversation is rendered with the tokenizer's chat template one message at
a time and each new piece is tokenised on its own, so the prompt part of a
training sequence is token for token what a server sees at generation time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from areal_kernel.api.io import ImageInputs, Trajectory
from areal_kernel.config.offline import ChatFormatConfig
from areal_kernel.errors import DataError

PAIR_FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    images: ImageInputs | None = None  # a vision-language record's images

    def trajectory(self, **metadata: Any) -> Trajectory:
        n = len(self.input_ids)
        return Trajectory(
            self.input_ids, self.loss_mask, [0.0] * n, [-1] * n, reward=0.0, metadata=metadata, images=self.images
        )


@dataclass
class PairExample:
    chosen: Encoded
    rejected: Encoded
    record_id: str


class ChatEncoder:
    """Turns messages into ``(input_ids, loss_mask)`` with a tokenizer and ``ChatFormatConfig``."""

    def __init__(self, tokenizer: Any, fmt: ChatFormatConfig, source: str = "dataset") -> None:
        self.tok = tokenizer
        self.fmt = fmt
        self.source = source
        if fmt.use_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"the tokenizer of this model has no chat template; set use_chat_template: false "
                f"in the algorithm section to train on plain text ({source})"
            )

    # -- messages ------------------------------------------------------------
    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def with_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.fmt.system_prompt and (not messages or messages[0].get("role") != "system"):
            return [{"role": "system", "content": self.fmt.system_prompt}, *messages]
        return messages

    def encode_messages(self, messages: list[dict[str, Any]], trainable: set[int], rid: str) -> Encoded:
        """Tokens of the conversation; message ``i`` in ``trainable`` (an
        assistant turn) carries loss on its tokens, template markers included
        (so the model learns to end its turn)."""
        if not self.fmt.use_chat_template:
            return self._encode_plain(messages, trainable, rid)
        ids: list[int] = []
        mask: list[int] = []
        done = ""  # text rendered so far
        for i, m in enumerate(messages):
            if i not in trainable:
                continue
            head = self._render(messages[:i], True) if i else ""
            full = self._render(messages[: i + 1], False)
            if not head.startswith(done) or not full.startswith(head):
                raise DataError(
                    f"{self.source}: record {rid!r}: the chat template does not render this conversation "
                    "incrementally (a prefix changes when messages are added), so answer tokens cannot be "
                    "located; set use_chat_template: false or use a template without that behaviour"
                )
            for text, train in ((head[len(done) :], 0), (full[len(head) :], 1)):
                piece = self._ids(text)
                ids += piece
                mask += [train] * len(piece)
            done = full
        whole = self._render(messages, False)
        rest = self._ids(whole[len(done) :]) if whole.startswith(done) else []
        ids += rest
        mask += [0] * len(rest)
        return self._finish(ids, mask)

    def _encode_plain(self, messages: list[dict[str, Any]], trainable: set[int], rid: str) -> Encoded:
        ids: list[int] = []
        mask: list[int] = []
        bos = getattr(self.tok, "bos_token_id", None)
        if bos is not None:
            ids, mask = [bos], [0]
        eos = getattr(self.tok, "eos_token_id", None)
        for i, m in enumerate(messages):
            piece = self._ids(str(m.get("content", "")))
            if i in trainable and eos is not None:
                piece = piece + [eos]
            ids += piece
            mask += [1 if i in trainable else 0] * len(piece)
        return self._finish(ids, mask)

    def _finish(self, ids: list[int], mask: list[int]) -> Encoded:
        limit = self.fmt.max_length
        ids, mask = ids[:limit], mask[:limit]
        if mask:
            mask[0] = 0  # the first token has no context to be scored
        return Encoded(ids, mask)

    # -- record shapes -------------------------------------------------------
    def as_messages(self, value: Any, role: str, field: str, rid: str) -> list[dict[str, Any]]:
        if isinstance(value, str):
            return [{"role": role, "content": value}]
        if isinstance(value, dict) and "content" in value:
            return [dict(value)]
        if (
            isinstance(value, list)
            and value
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
        ):
            return [dict(m) for m in value]
        raise DataError(
            f"{self.source}: record {rid!r}: field {field!r} must be a string or a list of "
            f"{{role, content}} messages, got {type(value).__name__}"
        )


def encode_sft_record(enc: ChatEncoder, rec: dict[str, Any], train_on: str) -> Encoded:
    rid = str(rec.get("id"))
    if rec.get("messages") is not None:
        msgs = enc.with_system(enc.as_messages(rec["messages"], "user", "messages", rid))
        assistant = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
        if not assistant:
            raise DataError(f"{enc.source}: record {rid!r}: 'messages' has no assistant turn to train on")
        if train_on == "all":
            # Every token after the first: train on the whole rendered text.
            e = enc.encode_messages(msgs, set(range(len(msgs))), rid)
            return Encoded(e.input_ids, [0] + [1] * (len(e.input_ids) - 1))
        trainable = {assistant[-1]} if train_on == "last_assistant" else set(assistant)
        return enc.encode_messages(msgs, trainable, rid)
    target = rec.get("completion", rec.get("answer"))
    if rec.get("prompt") is None or target is None or target == "":
        raise DataError(
            f"{enc.source}: record {rid!r} has neither 'messages' nor 'prompt' with 'completion' (or 'answer'); "
            f"fields present: {sorted(rec)}. Rename fields with dataset.field_map"
        )
    prompt = enc.with_system(enc.as_messages(rec["prompt"], "user", "prompt", rid))
    answer = enc.as_messages(
        str(target) if not isinstance(target, (list, dict)) else target, "assistant", "completion", rid
    )
    msgs = prompt + answer
    return enc.encode_messages(msgs, set(range(len(prompt), len(msgs))), rid)


def encode_sft_image_record(venc: Any, tokenizer: Any, rec: dict[str, Any], max_length: int | None) -> Encoded:
    """A record with ``images``, ``prompt`` and ``completion`` (or ``answer``):
    the prompt exactly as the ``vision_rlvr`` workflow renders it (``venc``, a
    ``VisionPromptEncoder``), then the answer and the template's end of turn,
    which carry the loss."""
    from areal_kernel.data.images import record_label

    target = rec.get("completion", rec.get("answer"))
    if rec.get("prompt") is None or target is None or target == "":
        raise DataError(f"{record_label(rec)} has images but no 'prompt' with 'completion' (or 'answer')")
    ids, images = venc.encode(rec)
    answer = str(target)
    if venc.config.use_chat_template:
        # The template's text after the generation prompt: the answer and its end-of-turn markers.
        msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "x"}]}]
        with_gen = venc.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        full = venc.processor.apply_chat_template(
            msgs + [{"role": "assistant", "content": [{"type": "text", "text": answer}]}], tokenize=False
        )
        tail = full[len(with_gen) :] if full.startswith(with_gen) else answer
    else:
        tail = answer
    ans = list(tokenizer(tail, add_special_tokens=False)["input_ids"])
    if not venc.config.use_chat_template and getattr(tokenizer, "eos_token_id", None) is not None:
        ans.append(int(tokenizer.eos_token_id))
    if max_length is not None and len(ids) + len(ans) > max_length:
        ans = ans[: max(0, max_length - len(ids))]
    return Encoded(ids + ans, [0] * len(ids) + [1] * len(ans), images=images)


def check_pair_fields(records: Sequence[dict[str, Any]], source: str) -> None:
    """One clear error for records that are not preference pairs."""
    for i, rec in enumerate(records):
        missing = [f for f in PAIR_FIELDS if rec.get(f) is None or rec.get(f) == "" or rec.get(f) == []]
        if missing:
            raise DataError(
                f"{source}: record {i} ({rec.get('id')!r}) lacks preference field(s) {missing}; preference "
                f"data needs {list(PAIR_FIELDS)} (fields present: {sorted(rec)}). Rename fields with dataset.field_map"
            )


def encode_pair(enc: ChatEncoder, rec: dict[str, Any]) -> PairExample | None:
    """Both answers after the same prompt; ``None`` when truncation to
    ``max_length`` leaves either without answer tokens."""
    rid = str(rec.get("id"))
    prompt = enc.with_system(enc.as_messages(rec["prompt"], "user", "prompt", rid))
    out = []
    for field in ("chosen", "rejected"):
        answer = enc.as_messages(rec[field], "assistant", field, rid)
        msgs = prompt + answer
        e = enc.encode_messages(msgs, set(range(len(prompt), len(msgs))), rid)
        if sum(e.loss_mask) == 0:
            return None
        out.append(e)
    return PairExample(out[0], out[1], rid)


def arithmetic_pairs(records: Sequence[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Preference pairs from arithmetic questions: correct answer chosen, a
    wrong one (correct +- 1..3, seeded per record) rejected."""
    out = []
    for i, rec in enumerate(records):
        rng = random.Random(f"{seed}:{rec.get('id', i)}")
        correct = int(rec["answer"])
        wrong = correct + rng.choice((-3, -2, -1, 1, 2, 3))
        out.append({**rec, "chosen": str(correct), "rejected": str(wrong)})
    return out
