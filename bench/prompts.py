"""Token ids of chat prompts for the benchmarks: each question as one user
turn through the model's chat template, with the generation prompt (what
the rlvr workflow sends a chat model)."""

from __future__ import annotations

from typing import Any, Iterable


def chat_prompt_ids(tokenizer: Any, questions: Iterable[str]) -> list[list[int]]:
    out = []
    for q in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        # Newer transformers return a BatchEncoding, older ones a list.
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out
