"""``ScalarHeadEngine``: the torch train engine with a scalar head instead of
the LM head, for reward models (one score per sequence).

The model is transformers' ``AutoModelForSequenceClassification`` with one
label, built from a causal-LM checkpoint (decoder weights reused, the ``score``
head newly initialised), so ``save_hf`` writes a directory that
``AutoModelForSequenceClassification.from_pretrained`` loads as a reward model.

Everything else (optimizer, lr schedule, micro-batching, packing, checkpoints)
is the torch engine's. Under the loss contract the first tensor a ``loss_fn``
gets is the per-token *score* ``head(hidden_t)`` (the reward of the sequence
read up to token ``t``) rather than a logprob; the entropy tensor is zeros.
``compute_values`` is ``compute_logprobs`` under its real name. The actor
engine is not touched: this is a subclass that overrides model loading and
the forward pass only.
"""

from __future__ import annotations

from typing import Any

from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.engine.config import TorchEngineConfig
from areal_kernel.engine.microbatch import MicroBatchRunner
from areal_kernel.engine.packing import PackedRow
from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.errors import ConfigError


class ScalarHeadRunner(MicroBatchRunner):
    """The micro-batch runner with the scalar head's forward."""

    def forward(
        self,
        row: PackedRow,
        *,
        entropy_grad: bool,
        scored: Any = None,
        tree: Any = None,
        images: dict[str, Any] | None = None,
    ) -> tuple[Any, Any]:
        """Per-token scores of one packed row (only at ``scored`` positions
        when given, 0 elsewhere) and a zero entropy."""
        import torch

        if tree is not None:  # pragma: no cover - share_prompts is forced off by ScalarHeadEngine
            raise ConfigError("ScalarHeadEngine does not run shared-prompt tree rows")
        if images:
            raise ConfigError("ScalarHeadEngine (critic, reward model) does not take images")
        n = row.input_ids.shape[0]
        dev = row.input_ids.device
        wanted = torch.ones(n, dtype=torch.bool, device=dev) if scored is None else scored
        pos = torch.nonzero(wanted, as_tuple=False)[:, 0]
        base = getattr(self.model, self.model.base_model_prefix)
        with self.autocast():
            hidden = base(
                input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False
            ).last_hidden_state[0]
            sel = self.model.score(hidden.index_select(0, pos))[:, 0]
        values = torch.zeros(n, dtype=torch.float32, device=dev).index_put((pos,), sel.float())
        return values, torch.zeros(n, dtype=torch.float32, device=dev)


class ScalarHeadEngine(TorchTrainEngine):
    def __init__(self, config: TorchEngineConfig | dict[str, Any] | None = None) -> None:
        super().__init__(config)
        if "share_prompts" in type(self.config).model_fields and getattr(self.config, "share_prompts"):
            # The shared-prompt tree forward is written for the LM head; packed
            # rows (exact, block-diagonal) are used here.
            self.config = self.config.model_copy(update={"share_prompts": False})

    def load_model(self, model_path: str, dtype: Any) -> Any:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        hf_cfg = AutoConfig.from_pretrained(model_path)
        if hf_cfg.pad_token_id is None:
            # HF's sequence classifiers find the last token through the pad id.
            eos = hf_cfg.eos_token_id
            hf_cfg.pad_token_id = eos[0] if isinstance(eos, list) else eos
        hf_cfg.num_labels = 1
        hf_cfg.problem_type = "regression"
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                model_path, config=hf_cfg, dtype=dtype, attn_implementation=self.config.attn_implementation
            )
        except ValueError as e:
            raise ConfigError(
                f"model {model_path!r} ({hf_cfg.model_type}) has no sequence-classification variant in "
                f"transformers, so it cannot carry a reward head: {e}"
            ) from None
        if getattr(model, "score", None) is None or getattr(model, model.base_model_prefix, None) is None:
            raise ConfigError(
                f"model {model_path!r} ({type(model).__name__}) lacks a 'score' head over its base model; "
                "reward models need a Llama/Qwen/Mistral-style sequence classifier"
            )
        return model

    def make_runner(self, model: Any) -> MicroBatchRunner:
        return ScalarHeadRunner(model, self.config, self.device)

    def compute_values(self, batch: TrajectoryBatch, only_loss_tokens: bool = False) -> list[list[float]]:
        """Per-token scores under the current weights (the sequence's reward is
        the score at its last token)."""
        return self.compute_logprobs(batch, only_loss_tokens)
