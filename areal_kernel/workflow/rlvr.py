"""Single-turn RL with verifiable rewards: prompt -> n samples -> reward each.

The prompt is rendered with the tokenizer's chat template; rewards run in the
kernel's reward pool (separate processes, enforced timeouts), so a slow or
crashing reward never blocks generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from areal_kernel.api.io import GenerationConfig, ImageInputs, ModelRequest, Trajectory, TrajectoryGroup
from areal_kernel.api.workflow import Workflow
from areal_kernel.errors import DataError
from areal_kernel.logging import get_logger
from areal_kernel.workflow.rlvr_config import RLVRConfig
from areal_kernel.workflow.scoring import RewardScoring

log = get_logger(__name__)


def fill_prompt_template(template: str, record: dict[str, Any], where: str) -> str:
    """``template`` (a ``prompt_template`` setting of section ``where``)
    formatted with ``record``'s fields; a field it names that the record
    lacks is a ``DataError`` naming both."""
    from areal_kernel.data.images import record_label

    try:
        return template.format(**record)
    except KeyError as e:
        raise DataError(
            f"{where}.prompt_template uses field {e} that {record_label(record)} lacks; fields: {sorted(record)}"
        ) from None


class _PromptSettings(Protocol):
    prompt_template: str
    system_prompt: str | None


_C = TypeVar("_C", bound=_PromptSettings)


class ChatWorkflow(RewardScoring, Workflow, Generic[_C]):
    """What the built-in workflows that render chats with the run's tokenizer
    (``rlvr``, ``multi_turn``) are built with: the keywords of
    ``Workflow.from_context``; the tokenizer's end-of-sequence id joins the
    stop tokens; no ``config`` means ``CONFIG()``, the section's defaults
    (``WHERE``, named in errors). A subclass builds the rest from its config
    in ``setup``; ``prompt_text`` and ``chat_ids`` turn a record into a prompt."""

    CONFIG: ClassVar[type[Any]]
    WHERE: ClassVar[str]

    def __init__(
        self,
        *,
        tokenizer: Any,
        gconfig: GenerationConfig,
        reward_target: str,
        reward_pool: Any,
        config: _C | None = None,
    ) -> None:
        self.tok = tokenizer
        self.gconfig = stop_at_eos(gconfig, tokenizer)
        self.reward_target = reward_target
        self.pool = reward_pool
        self.config: _C = config if config is not None else self.CONFIG()
        self.setup()

    def setup(self) -> None:
        """Called at the end of ``__init__``; the default builds nothing."""

    def prompt_text(self, record: dict[str, Any]) -> str:
        """``record`` through the config's ``prompt_template``."""
        return fill_prompt_template(self.config.prompt_template, record, self.WHERE)

    def chat_ids(self, text: str, system: str | None, **template_options: Any) -> list[int]:
        """The token ids of the chat template on (``system``,) the user's
        ``text`` and the assistant's generation prompt."""
        messages = [{"role": "user", "content": text}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_options)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)


class RLVRWorkflow(ChatWorkflow[RLVRConfig]):
    required_fields: tuple[str, ...] = ("prompt", "answer")
    CONFIG = RLVRConfig
    WHERE = "workflow.rlvr"

    def encode_prompt(self, record: dict[str, Any]) -> list[int]:
        text = self.prompt_text(record)
        if not self.config.use_chat_template:
            return list(self.tok(text, add_special_tokens=True)["input_ids"])
        return self.chat_ids(text, self.config.system_prompt)

    def prompt(self, record: dict[str, Any]) -> tuple[list[int], ImageInputs | None]:
        """The record's prompt as token ids, and its images (None here; the
        ``vision_rlvr`` workflow overrides this). Called once per episode: the
        samples of a prompt share the ids and the images object."""
        return self.encode_prompt(record), None

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    async def arun_episode(self, engine: Any, record: dict[str, Any]) -> TrajectoryGroup:
        input_ids, images = self.prompt(record)
        n = max(1, self.gconfig.n_samples)
        reqs = [
            ModelRequest(
                input_ids=input_ids,
                gconfig=sample_gconfig(self.gconfig, record, i),
                metadata={"record_id": record.get("id")},
                images=images,
            )
            for i in range(n)
        ]
        resps = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
        texts = [self.decode(r.output_ids) for r in resps]
        rewards = await asyncio.gather(*(self.score(t, record["answer"]) for t in texts))
        gid = str(record.get("id"))
        trajs = [
            Trajectory.from_response(r, reward, group_id=gid, sample_id=f"{gid}#{i}", metadata={"completion": t})
            for i, (r, reward, t) in enumerate(zip(resps, rewards, texts))
        ]
        return TrajectoryGroup(trajs, group_id=gid)

    async def aevaluate(self, engine: Any, record: dict[str, Any], max_new_tokens: int) -> tuple[float, str]:
        """Greedy answer to one record: (reward, completion)."""
        gconfig = self.gconfig.for_evaluation(max_new_tokens)
        input_ids, images = self.prompt(record)
        resp = await engine.agenerate(ModelRequest(input_ids=input_ids, gconfig=gconfig, images=images))
        text = self.decode(resp.output_ids)
        return await self.score(text, record["answer"]), text


def stop_at_eos(gconfig: GenerationConfig, tokenizer: Any) -> GenerationConfig:
    """``gconfig`` with the tokenizer's end-of-sequence id among its stop
    tokens. Returns a copy: the config is shared by every workflow built from
    the run's config, so adding to it in place would leak into the others."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None or eos in gconfig.stop_token_ids:
        return gconfig
    return dataclasses.replace(gconfig, stop_token_ids=[*gconfig.stop_token_ids, eos])


def sample_gconfig(gconfig: GenerationConfig, record: dict[str, Any], index: int) -> GenerationConfig:
    """The generation config of sample ``index`` of ``record``: seeded from the
    record's ``_sample_seed`` (set by the trainer's data stream) so that a
    resumed run regenerates the same samples; unseeded when the record has none."""
    base = record.get("_sample_seed")
    if base is None:
        return gconfig
    return dataclasses.replace(gconfig, seed=(int(base) + index) % (1 << 63))
