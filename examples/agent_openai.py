"""An arithmetic agent written with the official ``openai`` client, trained
through the kernel's OpenAI-compatible proxy without knowing it.

It asks the question; if the answer holds no number it asks once more for
just the number (a second turn); it scores itself (1.0 when the last number
it answered equals the record's answer) and returns that reward.

The same file works in both agent modes (docs/agents.md):

- inline: ``workflow.agent: {mode: inline, agent: "examples/agent_openai.py:ArithmeticAgent"}``
  (examples/agent_openai.yaml);
- subprocess: ``workflow.agent: {mode: subprocess, command: ["{python}", "examples/agent_openai.py"]}``.
  Run as a script it builds its client from ``OPENAI_BASE_URL`` and
  ``OPENAI_API_KEY`` as every ``openai`` program does, reads the record
  (JSON) from stdin and prints the reward as its last line.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Any

from openai import AsyncOpenAI

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ArithmeticAgent:
    def __init__(self, system_prompt: str = "Answer with a number.", max_tokens: int | None = None) -> None:
        self.system_prompt = system_prompt
        self.max_tokens = max_tokens

    async def run(self, record: dict[str, Any], *, base_url: str, api_key: str) -> float:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key)
        messages: list[Any] = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": str(record["prompt"])},
        ]
        extra = {"max_tokens": self.max_tokens} if self.max_tokens else {}
        try:
            for _ in range(2):
                reply = await client.chat.completions.create(model="areal", messages=messages, **extra)
                text = reply.choices[0].message.content or ""
                numbers = NUMBER.findall(text)
                if numbers:
                    return 1.0 if float(numbers[-1]) == float(record["answer"]) else 0.0
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": "Please answer with just the number."},
                ]
            return 0.0
        finally:
            await client.close()


async def _main() -> None:
    client = AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY, as for any openai program
    record = json.load(sys.stdin)
    reward = await ArithmeticAgent().run(record, base_url=str(client.base_url), api_key=client.api_key)
    await client.close()
    print(reward)


if __name__ == "__main__":
    asyncio.run(_main())
