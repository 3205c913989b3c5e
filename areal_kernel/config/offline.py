"""Settings of the offline trainers (``algorithm.sft``, ``algorithm.dpo``,
``algorithm.rm``): SFT, DPO/IPO and reward-model training need no inference
server, only a dataset, the train engine and (DPO/IPO) a frozen reference.

Importable without torch, like every config module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from areal_kernel.config.sections import StrictModel

# Keys that were fields of AlgorithmConfig (always present, validated, ignored
# unless selected) before these trainers registered their own config_model.
# A config written then (a run's config.yaml) holds all three; until the next
# minor release a section of these not read by the selected trainer is still
# validated, then dropped with a DeprecationWarning instead of refused.
FORMER_ALGORITHM_FIELDS = {"sft": "SFTConfig", "dpo": "DPOConfig", "rm": "RMConfig"}


class ChatFormatConfig(StrictModel):
    """How records become token sequences (shared by the three trainers)."""

    use_chat_template: bool = Field(
        True, description="Render prompts/answers with the tokenizer's chat template (else plain text + EOS)."
    )
    system_prompt: str | None = Field(None, description="Optional system message put before each prompt.")
    max_length: int = Field(
        1024, ge=8, description="Longest sequence in tokens; longer ones are cut from the end (answer tail)."
    )


class SFTConfig(ChatFormatConfig):
    """Supervised fine-tuning: next-token NLL on the answer tokens only."""

    loss_aggregation: Literal["token_mean", "seq_mean"] = Field(
        "token_mean",
        description="token_mean: every answer token of the batch weighs the same; "
        "seq_mean: mean per sequence first, then over sequences.",
    )
    train_on: Literal["assistant", "last_assistant", "all"] = Field(
        "assistant",
        description="Which tokens carry loss for chat records: every assistant turn, only the last, or "
        "every token after the first.",
    )


class DPOConfig(ChatFormatConfig):
    """DPO (``algorithm.type: dpo``) and IPO (``algorithm.type: ipo``) on preference pairs."""

    beta: float = Field(0.1, gt=0, description="Strength of the tie to the reference (DPO temperature; IPO 1/(2 tau)).")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="DPO only: assumed fraction of flipped labels (conservative DPO)."
    )
    average_log_prob: bool | None = Field(
        None,
        description="Score an answer by its mean token logprob instead of the sum. Default: sum for DPO, mean for IPO.",
    )
    ref_model_path: str | None = Field(None, description="Frozen reference model (default: model.path).")


class RMConfig(ChatFormatConfig):
    """Bradley-Terry reward model: a scalar head on the LM's last hidden state."""

    center_coef: float = Field(
        0.0, ge=0, description="Weight of (r_chosen + r_rejected)^2, which keeps scores centred on 0."
    )
