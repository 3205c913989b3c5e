"""Multi-turn RL: the model answers, the environment replies, up to ``max_turns``.

After each model turn the environment either runs the tools the model called
(tool results come back as ``tool_role`` messages), or scores the answer with
the reward: an answer that reaches the success threshold ends the episode,
one below it gets ``feedback`` as a user message and another turn.

One ``Trajectory`` per sample holds every turn in one row: the model's tokens
(loss mask 1, with their logprobs and weight versions, which may differ
between turns when weights changed in between) and the environment's tokens
(loss mask 0). Its reward is ``turn_discount**k`` times the reward of the
turn ``k`` (0-based) that ended the episode.

Token-exact turns: the prompt of turn k+1 is the prompt of turn k, plus the
exact ids turn k generated, plus the tokenised *delta* the chat template adds
for the new messages. The earlier text is never decoded and re-tokenised,
which would drift (the same text has several tokenisations, and the model
need not produce the canonical one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from areal_kernel.api.io import (
    SERVER_KEY,
    GenerationConfig,
    ModelRequest,
    ModelResponse,
    StopReason,
    Trajectory,
    TrajectoryGroup,
)
from areal_kernel.errors import ArealError
from areal_kernel.logging import get_logger
from areal_kernel.tools.runtime import ToolBox, build_tool_parser, turn_stop_reason
from areal_kernel.tools.types import ParsedOutput, ToolCallParser
from areal_kernel.workflow.multi_turn_config import WHERE, MultiTurnConfig
from areal_kernel.workflow.rlvr import ChatWorkflow, sample_gconfig

log = get_logger(__name__)

# Placeholder contents used to find what the chat template adds around a message.
_USER_MARK = "\x00areal-user\x00"
_ASSISTANT_MARK = "\x00areal-assistant\x00"


@dataclass
class Turn:
    """One model turn of an episode, for metadata and metrics."""

    text: str
    n_tokens: int
    stop_reason: str
    reward: float | None = None  # None: a tool-call turn (not scored)
    tool_calls: int = 0
    tool_errors: list[str] = field(default_factory=list)
    server: str | None = None  # the server that generated this turn


def reward_success_threshold(reward_target: str) -> float:
    """The ``success_threshold`` the reward registered under ``reward_target``
    declared (1.0 when none did, or the target is not a registered reward)."""
    from areal_kernel.plugins import get_registry
    from areal_kernel.api.reward import DEFAULT_SUCCESS_THRESHOLD

    for spec in get_registry().specs("reward"):
        if spec.target == reward_target and spec.success_threshold is not None:
            return float(spec.success_threshold)
    return DEFAULT_SUCCESS_THRESHOLD


class MultiTurnWorkflow(ChatWorkflow[MultiTurnConfig]):
    required_fields = ("prompt", "answer")
    CONFIG = MultiTurnConfig
    WHERE = WHERE  # the section these settings come from (multi_turn_config.WHERE)

    def setup(self) -> None:
        cfg = self.config
        self.parser: ToolCallParser | None = None
        self.toolbox: ToolBox | None = None
        if cfg.tools:
            self.parser = build_tool_parser(cfg.tool_parser, f"{WHERE}.tool_parser")
            self.toolbox = ToolBox.build(cfg.tools, cfg.tool_settings, cfg.tool_timeout_s, f"{WHERE}.tool_settings")
        self.stop_strings = list(self.parser.stop_strings) if self.parser is not None else []
        self.tool_schemas = self.toolbox.schemas() if self.toolbox is not None else None
        self.threshold = (
            cfg.success_threshold if cfg.success_threshold is not None else reward_success_threshold(self.reward_target)
        )
        self.assistant_closing = self._assistant_closing()

    # -- the chat template ---------------------------------------------------------
    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        text = self.tok.apply_chat_template(
            messages, tools=self.tool_schemas, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    def _base(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": _USER_MARK}, {"role": "assistant", "content": _ASSISTANT_MARK}]

    def _assistant_closing(self) -> str:
        """What the template writes after an assistant message's content
        (SmolLM2: ``<|im_end|>\\n``); the model generates part of it (its EOS)."""
        base = self._render(self._base(), False)
        i = base.rfind(_ASSISTANT_MARK)
        if i < 0:
            raise ArealError(f"{WHERE}: the chat template does not render assistant messages' content")
        return base[i + len(_ASSISTANT_MARK) :]

    def message_delta(self, messages: list[dict[str, Any]]) -> str:
        """The text the template adds after a finished assistant message for
        ``messages`` and the next assistant prompt."""
        base = self._render(self._base(), False)
        full = self._render([*self._base(), *messages], True)
        if not full.startswith(base):
            raise ArealError(
                f"{WHERE}: the chat template renders earlier messages differently once more follow, so turns "
                "cannot be appended token-exactly; use a template that only appends"
            )
        return full[len(base) :]

    def env_ids(self, resp: ModelResponse, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids that follow ``resp``'s output: the rest of the assistant
        message's closing (all of it unless the model ended on its stop
        token), then the template's delta for ``messages``. Only this new
        text is tokenised."""
        closing = self.assistant_closing
        out = resp.output_ids
        if (
            out
            and resp.stop_reason == StopReason.STOP
            and resp.matched_stop is None
            and out[-1] in self.gconfig.stop_token_ids
        ):
            ended = self.tok.decode(out[-1:], skip_special_tokens=False)
            if closing.startswith(ended):
                closing = closing[len(ended) :]
        text = closing + self.message_delta(messages)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode_prompt(self, record: dict[str, Any]) -> list[int]:
        system = self.config.system_prompt
        if system:
            system = system.replace("{tools}", json.dumps(self.tool_schemas or []))
        return self.chat_ids(self.prompt_text(record), system, tools=self.tool_schemas)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    # -- rewards and tools -----------------------------------------------------------
    def _parse(self, text: str) -> ParsedOutput | None:
        return self.parser.parse(text) if self.parser is not None else None

    async def _tool_messages(self, parsed: ParsedOutput, turn: Turn) -> list[dict[str, Any]]:
        """Run the turn's calls (in order) and return their results as
        messages; malformed calls and calls over the per-turn limit answer
        with an error, so the model learns what went wrong."""
        assert self.toolbox is not None
        role = self.config.tool_role
        limit = self.config.max_tool_calls_per_turn
        messages: list[dict[str, Any]] = []
        for i, call in enumerate(parsed.tool_calls):
            if i >= limit:
                content = f"error: at most {limit} tool calls per turn; '{call.name}' was not run"
                turn.tool_errors.append(content)
            else:
                res = await self.toolbox.execute(call)
                content = res.content
                if not res.ok:
                    turn.tool_errors.append(content)
            messages.append({"role": role, "content": content, "tool_call_id": call.id, "name": call.name})
        for err in parsed.errors:
            turn.tool_errors.append(err)
            messages.append({"role": role, "content": f"error: {err}"})
        turn.tool_calls = len(parsed.tool_calls)
        return messages

    # -- episodes --------------------------------------------------------------------
    async def _generate(self, engine: Any, ids: list[int], gconfig: GenerationConfig, record: dict) -> ModelResponse:
        room = self.config.max_total_tokens - len(ids)
        g = dataclasses.replace(
            gconfig, max_new_tokens=max(1, min(gconfig.max_new_tokens, room)), stop=list(self.stop_strings)
        )
        return await engine.agenerate(
            ModelRequest(input_ids=list(ids), gconfig=g, metadata={"record_id": record.get("id")})
        )

    async def _sample(self, engine: Any, record: dict[str, Any], prompt: list[int], gconfig: GenerationConfig) -> Any:
        cfg = self.config
        ids, mask, lps, vers = list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt)
        turns: list[Turn] = []
        reward = 0.0
        for k in range(cfg.max_turns):
            resp = await self._generate(engine, ids, gconfig, record)
            ids += resp.output_ids
            mask += [1] * resp.output_len
            lps += list(resp.output_logprobs)
            vers += list(resp.output_versions)
            text = self.decode(resp.output_ids)
            turn = Turn(
                text=text,
                n_tokens=resp.output_len,
                stop_reason=turn_stop_reason(resp, self.parser).value,
                server=resp.server,
            )
            turns.append(turn)
            parsed = self._parse(text)
            last = k == cfg.max_turns - 1
            if parsed is not None and (parsed.tool_calls or parsed.errors) and not last:
                messages = await self._tool_messages(parsed, turn)
            else:
                turn.reward = await self.score(text, record["answer"])
                reward = turn.reward * cfg.turn_discount**k
                if turn.reward >= self.threshold or last:
                    break
                messages = [{"role": "user", "content": cfg.feedback}]
            env = self.env_ids(resp, messages)
            if len(ids) + len(env) + 1 >= cfg.max_total_tokens:
                break  # no room for another turn: the episode ends here
            ids += env
            mask += [0] * len(env)
            lps += [0.0] * len(env)
            vers += [-1] * len(env)
        return ids, mask, lps, vers, reward, turns

    def _metrics(self, turns: list[Turn]) -> dict[str, float]:
        """Per-sample numbers the trainer averages into ``workflow/<name>``."""
        ok = [t.reward is not None and t.reward >= self.threshold for t in turns]
        out = {
            "turns": float(len(turns)),
            "tool_calls": float(sum(t.tool_calls for t in turns)),
            "tool_errors": float(sum(len(t.tool_errors) for t in turns)),
            "success": float(any(ok)),
        }
        if turns[0].reward is not None:
            out["first_turn_success"] = float(ok[0])
            # Only samples that got feedback after a wrong first answer count.
            if not ok[0] and len(turns) > 1 and turns[1].reward is not None:
                out["second_turn_success"] = float(ok[1])
        return out

    async def arun_episode(self, engine: Any, record: dict[str, Any]) -> TrajectoryGroup:
        prompt = self.encode_prompt(record)
        n = max(1, self.gconfig.n_samples)
        results = await asyncio.gather(
            *(self._sample(engine, record, prompt, sample_gconfig(self.gconfig, record, i)) for i in range(n))
        )
        gid = str(record.get("id"))
        trajs = []
        for i, (ids, mask, lps, vers, reward, turns) in enumerate(results):
            meta = {
                "completion": turns[-1].text,
                "turns": [dataclasses.asdict(t) for t in turns],
                "metrics": self._metrics(turns),
            }
            servers = list(dict.fromkeys(t.server for t in turns if t.server))
            if servers:
                meta[SERVER_KEY] = ",".join(servers)
            trajs.append(Trajectory(ids, mask, lps, vers, reward, group_id=gid, sample_id=f"{gid}#{i}", metadata=meta))
        return TrajectoryGroup(trajs, group_id=gid)

    async def aevaluate(self, engine: Any, record: dict[str, Any], max_new_tokens: int) -> tuple[float, str]:
        """One greedy answer, scored once: tool calls are answered (up to
        ``max_turns`` turns) but a wrong answer gets no second try, so the
        held-out accuracy is that of the first answer."""
        gconfig = self.gconfig.for_evaluation(max_new_tokens)
        ids = self.encode_prompt(record)
        text = ""
        for k in range(self.config.max_turns):
            resp = await self._generate(engine, ids, gconfig, record)
            text = self.decode(resp.output_ids)
            parsed = self._parse(text)
            if not (parsed is not None and (parsed.tool_calls or parsed.errors)) or k == self.config.max_turns - 1:
                break
            env = self.env_ids(resp, await self._tool_messages(parsed, Turn(text, resp.output_len, "")))
            if len(ids) + resp.output_len + len(env) + 1 >= self.config.max_total_tokens:
                break
            ids = ids + list(resp.output_ids) + env
        return await self.score(text, record["answer"]), text
