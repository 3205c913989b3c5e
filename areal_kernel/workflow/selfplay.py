"""A two-role arithmetic game: one policy asks, another answers, in one episode.

The workflow of the asking policy of a multi-policy run (docs/multi-policy.md,
"Several roles in one episode"). Per record (its ``answer`` is the target):

1. the asker (this workflow's adapter, ``rollout.gconfig.n_samples``
   samples) writes a question "What is A op B?" whose answer should be the
   target;
2. each question the answerer can be asked (see ``asker_scoring``) is put to
   the ``answerer`` adapter ``answers_per_question`` times.

Rewards, separately: a question scores the run's reward of its value (as
text) against the target (``math``: 1 when the value is the target; a
malformed question 0); an answer scores the run's reward against the
question's value. One ``TrajectoryGroup`` per episode holds both roles:
every trajectory names its adapter (``metadata[ADAPTER_KEY]``), which the
multi-policy trainer routes to that policy's batch; the asker's samples share
the record's ``group_id``, each question's answers get ``<group_id>/q<i>``
(advantages are taken within each). An answer's trajectory records the
question's provenance (``metadata["question"]``: the asker's adapter, the
versions that wrote it, its text): its prompt tokens were the asker's output,
its generated tokens (``loss_mask`` 1, ``versions``) the answerer's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Any

from areal_kernel.api.io import ADAPTER_KEY, ModelRequest, Trajectory, TrajectoryGroup
from areal_kernel.api.workflow import COMPLETION_KEY, SAMPLE_METRICS_KEY
from areal_kernel.errors import ArealError, ConfigError
from areal_kernel.workflow.rlvr import ChatWorkflow, fill_prompt_template, sample_gconfig
from areal_kernel.workflow.selfplay_config import WHERE, SelfPlayConfig

_QUESTION = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class SelfPlayWorkflow(ChatWorkflow[Any]):
    # Any: its settings have no prompt_template/system_prompt (it renders its
    # own two prompts), which ChatWorkflow's type parameter asks for.
    config: SelfPlayConfig
    required_fields = ("answer",)
    CONFIG = SelfPlayConfig
    WHERE = WHERE

    def setup(self) -> None:
        if self.config.answerer == self.gconfig.adapter:
            raise ConfigError(f"{WHERE}.answerer: {self.config.answerer!r} is the asker's own adapter; name the other")

    @property
    def asker(self) -> str:
        if self.gconfig.adapter is None:
            raise ArealError(
                f"{WHERE}: the asking policy's adapter is unknown; run this workflow as a policy's workflow in a "
                "multi-policy run (policies:, docs/multi-policy.md)"
            )
        return self.gconfig.adapter

    def encode_prompt(self, record: dict[str, Any]) -> list[int]:
        fields = {"op": self.config.op, "max_operand": self.config.max_operand, **record}
        return self.chat_ids(fill_prompt_template(self.config.asker_prompt, fields, WHERE), None)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True)).strip()

    def question_value(self, question: str) -> int | None:
        """The value of the first "A op B" in ``question`` when it uses the
        configured operator and operands in ``[0, max_operand]``, else None."""
        m = _QUESTION.search(question)
        if m is None or m.group(2) != self.config.op:
            return None
        a, b = int(m.group(1)), int(m.group(3))
        if not (0 <= a <= self.config.max_operand and 0 <= b <= self.config.max_operand):
            return None
        return _OPS[self.config.op](a, b)

    async def _question_reward(self, question: str, value: int | None, target: Any) -> float:
        if self.config.asker_scoring == "text":
            return await self.score(question, target)
        return 0.0 if value is None else await self.score(str(value), target)

    def _answer_key(self, value: int | None, target: Any) -> Any:
        if value is not None:
            return value
        return target if self.config.asker_scoring == "text" else None

    async def _answers(
        self, engine: Any, record: dict[str, Any], question: str, key: Any, first_seed: int
    ) -> list[tuple[Any, float, str]]:
        ids = self.chat_ids(self.config.answerer_prompt.format(question=question), None)
        m = self.config.answers_per_question
        gconfigs = [
            dataclasses.replace(
                sample_gconfig(self.gconfig, record, first_seed + j),
                adapter=self.config.answerer,
                max_new_tokens=self.config.answer_tokens,
            )
            for j in range(m)
        ]
        resps = await asyncio.gather(
            *(engine.agenerate(ModelRequest(ids, g, metadata={"record_id": record.get("id")})) for g in gconfigs)
        )
        texts = [self.decode(r.output_ids) for r in resps]
        rewards = await asyncio.gather(*(self.score(t, key) for t in texts))
        return list(zip(resps, rewards, texts))

    async def arun_episode(self, engine: Any, record: dict[str, Any]) -> TrajectoryGroup:
        asker, target, gid = self.asker, record["answer"], str(record.get("id"))
        prompt = self.encode_prompt(record)
        n = max(1, self.gconfig.n_samples)
        q_resps = await asyncio.gather(
            *(
                engine.agenerate(
                    ModelRequest(
                        prompt, sample_gconfig(self.gconfig, record, i), metadata={"record_id": record.get("id")}
                    )
                )
                for i in range(n)
            )
        )
        questions = [self.decode(r.output_ids) for r in q_resps]
        values = [self.question_value(q) for q in questions]
        q_rewards = await asyncio.gather(*(self._question_reward(q, v, target) for q, v in zip(questions, values)))
        keys = [self._answer_key(v, target) for v in values]
        asked = [i for i in range(n) if keys[i] is not None]
        m = self.config.answers_per_question
        answers = await asyncio.gather(
            *(self._answers(engine, record, questions[i], keys[i], n + i * m) for i in asked)
        )
        trajs = []
        for i, (resp, reward, question) in enumerate(zip(q_resps, q_rewards, questions)):
            meta = {
                COMPLETION_KEY: question,
                ADAPTER_KEY: asker,
                SAMPLE_METRICS_KEY: {"question_well_formed": float(values[i] is not None)},
            }
            trajs.append(Trajectory.from_response(resp, reward, group_id=gid, sample_id=f"{gid}#q{i}", metadata=meta))
        for i, got in zip(asked, answers):
            source = {"adapter": asker, "versions": sorted(set(q_resps[i].output_versions)), "text": questions[i]}
            for j, (resp, reward, text) in enumerate(got):
                meta = {
                    COMPLETION_KEY: text,
                    ADAPTER_KEY: self.config.answerer,
                    "question": source,
                    SAMPLE_METRICS_KEY: {"answer_reward": reward},
                }
                trajs.append(
                    Trajectory.from_response(
                        resp, reward, group_id=f"{gid}/q{i}", sample_id=f"{gid}#q{i}a{j}", metadata=meta
                    )
                )
        return TrajectoryGroup(trajs, group_id=gid)

    async def aevaluate(self, engine: Any, record: dict[str, Any], max_new_tokens: int) -> tuple[float, str]:
        """The asker's greedy question to one record, scored as in training."""
        gconfig = dataclasses.replace(self.gconfig.for_evaluation(max_new_tokens), adapter=self.asker)
        resp = await engine.agenerate(ModelRequest(input_ids=self.encode_prompt(record), gconfig=gconfig))
        question = self.decode(resp.output_ids)
        return await self._question_reward(question, self.question_value(question), record["answer"]), question
