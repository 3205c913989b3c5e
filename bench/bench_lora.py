"""LoRA vs full fine-tuning on SmolLM2-135M: bytes and seconds per weight
update into one embedded server (the kernel's disk transport; LoRA ships the
adapter alone), and train-step time and training-state memory of the torch
engine with and without the adapter of examples/grpo_lora.yaml.

    .venv/bin/python bench/bench_lora.py [--repeats 3]

Memory is the training state the engine holds beyond the frozen weights:
gradients plus AdamW moments (what LoRA removes), counted from the tensors,
not the process RSS (which the shared model weights dominate).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")

LORA = {
    "rank": 16,
    "alpha": 32,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def _batch(seed: int, vocab: int):
    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    rng = random.Random(seed)
    trajs = []
    for k in range(8):
        ids = [rng.randrange(vocab) for _ in range(64)]
        trajs.append(Trajectory(ids, [0] * 40 + [1] * 24, [-2.0] * 64, [-1] * 40 + [0] * 24, float(k % 2)))
    return TrajectoryBatch(trajs)


def _loss(logprobs, entropy, data):
    mask = data["loss_mask"]
    return -(logprobs * mask * (data["rewards"] * 2 - 1)).sum() / data["batch_loss_tokens"], {}


def _state_bytes(engine) -> int:
    n = 0
    for p in engine.model.parameters():
        if p.grad is not None:
            n += p.grad.numel() * p.grad.element_size()
    for st in engine.optimizer.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values() if hasattr(t, "numel") and t.dim() > 0)
    return n


def main() -> None:
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
    from areal_kernel.models.resolve import resolve_model_path
    from areal_kernel.trainer.weight_sync import DiskTransport

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    model_dir = resolve_model_path(args.model)
    rows = {}
    with tempfile.TemporaryDirectory() as run_dir:
        launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=run_dir)
        try:
            infos = launcher.launch(model_dir, n_servers=1, devices_per_server=0)
            client = RemoteInferenceEngine([i.address for i in infos], EmbeddedProtocol())
            for name, lora in (("full", None), ("lora", LORA)):
                engine = TorchTrainEngine({"lr": 1e-5, "lora": lora, "max_tokens_per_mb": 1024})
                engine.initialize(model_dir, 100)
                vocab = int(engine.model.config.vocab_size)
                step_s = []
                for s in range(args.repeats + 1):
                    t0 = time.perf_counter()
                    engine.train_batch(_batch(s, vocab), _loss)
                    step_s.append(time.perf_counter() - t0)
                mem = _state_bytes(engine)
                t = DiskTransport(engine, client, os.path.join(run_dir, name))
                t.setup()
                upd_s, mb = [], 0.0
                for v in range(1, args.repeats + 1):
                    t0 = time.monotonic()
                    m = t.update(v)
                    upd_s.append(time.monotonic() - t0)
                    mb = m["weights/mb"]
                # The first step pays one-time allocations: left out of the median.
                rows[name] = (statistics.median(upd_s), mb, statistics.median(step_s[1:]), mem / 2**20)
                if lora is not None:
                    client.unload_adapter(engine.adapter_spec().name)
                engine.destroy()
                del engine
        finally:
            launcher.stop()
    print("\n| SmolLM2-135M | update s (median) | update MB | train step s (median) | grads + AdamW MB |")
    print("|---|---|---|---|---|")
    for name, (us, mb, ss, mem) in rows.items():
        print(f"| {name} | {us:.2f} | {mb:.1f} | {ss:.2f} | {mem:.0f} |")
    f, lo = rows["full"], rows["lora"]
    print("\n| full / lora | ratio |")
    print("|---|---|")
    for label, i in (("update bytes", 1), ("update seconds", 0), ("train step seconds", 2), ("grads + AdamW memory", 3)):
        print(f"| {label} | {f[i] / lo[i]:.1f}x |")
    report("LoRA weight update: full / adapter bytes", f[1] / lo[1], goal=10)
    report("LoRA weight update: full / adapter seconds", f[0] / lo[0])
    report("LoRA train step: full / adapter seconds", f[2] / lo[2])
    report("LoRA training state: full / adapter grads+AdamW bytes", f[3] / lo[3])


if __name__ == "__main__":
    main()
