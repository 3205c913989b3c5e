"""Settings of the ``selfplay`` workflow (``workflow.selfplay``), importable without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

WHERE = "workflow.selfplay"

ASKER_PROMPT = (
    "Write one question of the form 'What is A {op} B?' where A and B are whole numbers from 0 to "
    "{max_operand} and the answer is {answer}. Reply with the question only."
)
ANSWERER_PROMPT = "{question} Answer with just the number."


class SelfPlayConfig(BaseModel):
    """Two roles in one episode: the policy whose workflow this is (the
    asker) writes a question, the ``answerer`` policy answers it."""

    model_config = ConfigDict(extra="forbid")

    answerer: str = Field(
        ...,
        description="The policy (adapter) that answers the questions; its policy section sets episodes_from to "
        "the asker's.",
    )
    op: Literal["+", "-", "*"] = Field("+", description="The operator questions must use.")
    max_operand: int = Field(9, ge=0, description="Largest operand a well-formed question may use.")
    answers_per_question: int = Field(4, ge=1, description="Answers sampled per question (the answerer's group).")
    answer_tokens: int = Field(8, ge=1, description="Most tokens per answer (questions: rollout.gconfig's).")
    asker_prompt: str = Field(
        ASKER_PROMPT, description="Format string over the record's fields plus op and max_operand."
    )
    answerer_prompt: str = Field(ANSWERER_PROMPT, description="Format string over {question}.")
    asker_scoring: Literal["value", "text"] = Field(
        "value",
        description="value: a question must read 'A op B' with operands in range; the run's reward scores its "
        "value (as text) against the record's answer, and a malformed one scores 0 and is not answered. text: "
        "the run's reward scores the question's text itself, and every question is answered (the answer key: "
        "its value, else the record's answer); for rewards that read any text (char_share).",
    )
