"""SFT: next-token NLL on the answer (assistant) tokens of chat records."""

from __future__ import annotations

import math
from typing import Any

from areal_kernel.api.io import TrajectoryBatch
from areal_kernel.config.offline import SFTConfig
from areal_kernel.logging import get_logger
from areal_kernel.trainer.offline import OfflineTrainer
from areal_kernel.trainer.offline_data import ChatEncoder, Encoded, encode_sft_image_record, encode_sft_record

log = get_logger(__name__)


class SFTTrainer(OfflineTrainer):
    """``algorithm.type: sft``; settings (``SFTConfig``) in ``algorithm.sft``."""

    headline = ("eval/loss", "held-out answer NLL (per token)")

    @property
    def sft(self) -> SFTConfig:
        return self.settings_of(SFTConfig)

    def encode(self, records: list[dict[str, Any]], split: str) -> list[Encoded]:
        c = self.sft
        enc = ChatEncoder(self.tokenizer, c, self.source)
        venc = None
        if any("images" in rec for rec in records):
            # Image records: prompts rendered by the model's processor, as the vision_rlvr workflow does.
            from areal_kernel.workflow.rlvr_config import RLVRConfig
            from areal_kernel.workflow.vision import VisionPromptEncoder, load_processor

            fmt = RLVRConfig(use_chat_template=c.use_chat_template, system_prompt=c.system_prompt)
            venc = VisionPromptEncoder(load_processor(self.model_dir), fmt)
        out = [
            encode_sft_image_record(venc, self.tokenizer, rec, c.max_length)
            if venc is not None and "images" in rec
            else encode_sft_record(enc, rec, c.train_on)
            for rec in records
        ]
        kept = [e for e in out if sum(e.loss_mask) > 0]
        if len(kept) < len(out):
            log.warning(
                "records without answer tokens after truncation were dropped",
                split=split, dropped=len(out) - len(kept), max_length=c.max_length,
            )  # fmt: skip
        return kept

    def train_step(self, items: list[Encoded]) -> dict[str, float]:
        from areal_kernel.algo.sft_losses import make_sft_loss_fn

        batch = TrajectoryBatch([e.trajectory() for e in items])
        stats = self.trained_engine().train_batch(batch, make_sft_loss_fn(self.sft.loss_aggregation))
        stats["nll"] = stats.get("nll_sum", 0.0) / max(stats.get("nll_tokens", 1.0), 1.0)
        return stats

    def evaluate(self) -> dict[str, float]:
        """Token-mean NLL of the held-out answers under the current weights."""
        nll, tokens = 0.0, 0
        bs = max(self.cfg.trainer.batch_size, 1)
        engine = self.trained_engine()
        for i in range(0, len(self.eval_examples), bs):
            chunk = self.eval_examples[i : i + bs]
            lps = engine.compute_logprobs(TrajectoryBatch([e.trajectory() for e in chunk]), only_loss_tokens=True)
            for e, lp in zip(chunk, lps):
                for m, x in zip(e.loss_mask, lp):
                    if m:
                        nll -= x
                        tokens += 1
        loss = nll / max(tokens, 1)
        return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0))}
