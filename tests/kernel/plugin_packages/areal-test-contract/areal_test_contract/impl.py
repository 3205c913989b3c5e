"""What a third party writes from docs/plugin-authoring.md, plus one
deliberately broken dataset per case the kernel must report clearly."""
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.api.io import GenerationConfig, ModelRequest, Trajectory, TrajectoryGroup
from areal_kernel.api.workflow import Workflow
from areal_kernel.errors import DataError
from areal_kernel.workflow.rlvr import sample_gconfig, stop_at_eos
from areal_kernel.workflow.scoring import RewardScoring


class LengthPenaltyConfig(BaseModel):
    per_token: float = Field(0.01, ge=0)


def length_penalty(completion: str, answer: str, *, per_token: float = 0.01) -> float:
    correct = completion.strip() == answer.strip()
    return float(correct) - per_token * len(completion.split())


class EchoValueConfig(BaseModel):
    value: float = 0.5  # differs from the function's default: the config model's must win
    tags: tuple[str, ...] = ("a",)


def echo_value(completion: str, answer: str, *, value: float = 0.0, tags: list[str] | None = None) -> float:
    # Settings travel as JSON: a tuple field must arrive as a list of strings.
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise TypeError(f"tags arrived as {type(tags).__name__}")
    return float(value)


class ScaledConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scale: float = 2.0  # the only default: the function's keyword has none


def scaled(completion: str, answer: str, *, scale: float) -> float:
    return scale * float(completion.strip() == answer.strip())


class ContractDataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt dataset.contract_data key is an error

    mode: Literal[
        "list", "tuple", "list_no_id", "no_answer", "no_id", "dup_id", "not_dict", "wrong_shape", "three", "raise", "areal_error"
    ] = "list"
    n: int = Field(8, ge=1)


def _records(n: int) -> list[dict]:
    return [{"id": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(n)]


def contract_data(config, seed: int, required: tuple[str, ...]):
    c: ContractDataConfig = config.plugin_config or ContractDataConfig()
    records = _records(c.n)
    if c.mode == "list":  # the documented plain list: the kernel holds out the eval part
        return records
    if c.mode == "tuple":  # the documented (train, eval) tuple
        return records[: c.n // 2], records[c.n // 2 :]
    if c.mode == "list_no_id":
        return [{k: v for k, v in r.items() if k != "id"} for r in records]
    if c.mode == "no_answer":
        del records[2]["answer"]
    elif c.mode == "no_id":
        for r in records:
            del r["id"]
    elif c.mode == "dup_id":
        records[4]["id"] = records[1]["id"]
    elif c.mode == "not_dict":
        records[3] = "What is 3 + 1?"
    elif c.mode == "wrong_shape":
        return {"train": records}
    elif c.mode == "three":
        return records[:4], records[4:6], records[6:]
    elif c.mode == "raise":
        raise ValueError(f"boom from the dataset (seed {seed})")
    elif c.mode == "areal_error":
        raise DataError("contract_data: the record server is down; set dataset.contract_data.mode=list")
    # The broken cases come as a (train, eval) tuple, so only the record check can catch them.
    return records, []


class CrashyWorkflow:
    required_fields = ("prompt",)

    def __init__(self, **kwargs):
        pass

    async def arun_episode(self, engine, record):
        return {"n": 1}["answer"]  # the bug: a plain KeyError from plugin code


class MinimalWorkflow(RewardScoring, Workflow):
    """Only the members docs/plugin-authoring.md ("Workflows") requires, on
    the documented base class: ``encode_prompt`` is the ``Workflow``
    default (it raises ``NotImplementedError``), and its trajectories carry
    no ``metadata["completion"]``."""

    required_fields = ("prompt", "answer")

    def __init__(self, *, tokenizer, gconfig, reward_target, reward_pool, config=None):
        self.tok = tokenizer
        self.gconfig = stop_at_eos(gconfig, tokenizer)
        self.reward_target = reward_target
        self.pool = reward_pool

    def _ids(self, record) -> list[int]:
        messages = [{"role": "user", "content": record["prompt"]}]
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def arun_episode(self, engine, record):
        ids, gid = self._ids(record), str(record["id"])
        trajectories = []
        for i in range(max(1, self.gconfig.n_samples)):
            resp = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=sample_gconfig(self.gconfig, record, i)))
            text = self.tok.decode(resp.output_ids, skip_special_tokens=True)
            reward = await self.score(text, record["answer"])
            trajectories.append(Trajectory.from_response(resp, reward, group_id=gid, sample_id=f"{gid}#{i}"))
        return TrajectoryGroup(trajectories, group_id=gid)

    async def aevaluate(self, engine, record, max_new_tokens):
        g = GenerationConfig(max_new_tokens=max_new_tokens, greedy=True, stop_token_ids=list(self.gconfig.stop_token_ids))
        resp = await engine.agenerate(ModelRequest(input_ids=self._ids(record), gconfig=g))
        text = self.tok.decode(resp.output_ids, skip_special_tokens=True)
        return await self.score(text, record["answer"]), text


class InflatingWorkflow(MinimalWorkflow):
    """Breaks the reward rule: a trajectory's reward above every score of its reward calls."""

    async def score(self, completion, answer):
        return 2.0 * await super().score(completion, answer) + 0.5
