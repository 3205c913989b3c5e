"""``ChatAgent``: the smallest agent, for configs and tests that need one
without the ``openai`` package (it speaks the same wire format with aiohttp)."""

from __future__ import annotations

from typing import Any


class ChatAgent:
    """Asks ``prompt_template.format(**record)`` (after an optional system
    message) once and returns ``None``: the run's reward scores the answer.

    ``workflow.agent: {agent: "areal_kernel.agent.simple:ChatAgent",
    agent_kwargs: {system_prompt: ..., prompt_template: ...}}``."""

    def __init__(self, system_prompt: str | None = None, prompt_template: str = "{prompt}") -> None:
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template

    async def run(self, record: dict[str, Any], *, base_url: str, api_key: str) -> float | None:
        import aiohttp

        messages = [{"role": "user", "content": self.prompt_template.format(**record)}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{base_url}/chat/completions",
                json={"model": "areal", "messages": messages},
                headers={"Authorization": f"Bearer {api_key}"},
            ) as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"chat completion failed (HTTP {resp.status}): {body}")
        return None
