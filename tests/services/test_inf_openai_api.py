"""The gateway's OpenAI bodies -> token ids, with a real tokenizer and chat
template (SmolLM2's): a message role that is not a chat role is one clear
400 naming the message, as a typo should be, rather than a speaker the
template renders."""

from __future__ import annotations

import pytest

from areal_kernel.services.inf.openai_api import OpenAIError, chat_prompt_ids


@pytest.fixture(scope="module")
def tokenizer(areal_tiny_chat_model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(areal_tiny_chat_model_dir)


def test_chat_roles_are_checked(tokenizer) -> None:
    ok = chat_prompt_ids(tokenizer, {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
                         "m")  # fmt: skip
    assert ok and isinstance(ok[0], int)
    with pytest.raises(OpenAIError) as e:
        chat_prompt_ids(tokenizer, {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]},
                        "m")  # fmt: skip
    assert e.value.status == 400 and e.value.param == "messages"
    assert "messages[1].role: 'wizard' is not a chat role; expected one of system, developer, user" in str(e.value)
