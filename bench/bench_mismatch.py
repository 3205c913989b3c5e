"""Cost of the train/inference mismatch metrics (``monitor.mismatch``) per
training step: SmolLM2-135M, the torch train engine, one GRPO step
(``rl_train_step``) on the same batch with the metrics (what every run does)
and without them (the wrapper that adds them replaced by the bare loss),
alternating so that drift of the machine hits both arms alike.

    .venv/bin/python bench/bench_mismatch.py [--repeats 5] [--groups 8] [--tokens 96]

Two numbers: the step-time ratio (with / without; on a shared machine its
noise is a few percent either way) and the time spent inside the metrics'
own computation (``areal_kernel.monitor.mismatch.measure``, timed directly)
as a fraction of the step: the headline, free of step-to-step noise.
Goal: under 5% of a step, like the weight-delivery check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    import areal_kernel.algo.rl as rl
    import areal_kernel.monitor.mismatch as mismatch
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.models.resolve import resolve_model_path
    from areal_kernel.testing.rank_engines import random_batch

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--groups", type=int, default=8, help="GRPO groups of 2 samples")
    ap.add_argument("--tokens", type=int, default=96, help="tokens per sample (prompt 32)")
    args = ap.parse_args()
    model_dir = resolve_model_path(args.model)
    engine = TorchTrainEngine({"lr": 1e-7})
    engine.initialize(model_dir, 10 * args.repeats)
    batch = random_batch([args.tokens] * (2 * args.groups), seed=1, prompt_len=32, vocab=49152, shared_prompts=True)
    cfg = rl.RLConfig()

    measure_s: list[float] = []
    real_measure = mismatch.measure

    def timed_measure(*a, **k):
        t = time.perf_counter()
        try:
            return real_measure(*a, **k)
        finally:
            measure_s.append(time.perf_counter() - t)

    real_wrapper = rl.measured_loss
    mismatch.measure = timed_measure  # measured_loss looks it up at call time

    def step(with_metrics: bool) -> tuple[float, dict]:
        rl.measured_loss = real_wrapper if with_metrics else (lambda fn, version, threshold: fn)
        try:
            t = time.perf_counter()
            stats = rl.rl_train_step(batch, engine, cfg)
            return time.perf_counter() - t, stats
        finally:
            rl.measured_loss = real_wrapper

    step(True)  # warm-up (allocator, first autograd graph)
    on: list[float] = []
    off: list[float] = []
    inside: list[float] = []
    for _ in range(args.repeats):
        measure_s.clear()
        s, stats = step(True)
        assert stats.get("mismatch"), "the metrics were not computed"  # the bench measures what it says
        on.append(s)
        inside.append(sum(measure_s))
        s, stats = step(False)
        assert not stats.get("mismatch"), stats.get("mismatch")
        off.append(s)
    mismatch.measure = real_measure
    m_on, m_off, m_in = statistics.median(on), statistics.median(off), statistics.median(inside)
    n_tokens = sum(len(t.input_ids) for t in batch.trajectories)
    print(f"\n{args.model}, {len(batch)} sequences x {args.tokens} tokens ({n_tokens} tokens), median of {args.repeats}")
    print("\n| arm | step s | metrics' own s | of the step |")
    print("|---|---|---|---|")
    print(f"| with monitor.mismatch metrics | {m_on:.3f} | {m_in:.5f} | {100 * m_in / m_on:.3f}% |")
    print(f"| without | {m_off:.3f} | - | - |")
    print(f"\nstep time with / without: {m_on / m_off:.3f}")
    report("mismatch metrics' own seconds / GRPO step seconds", m_in / m_on, 0.05, higher_is_better=False)
    report("GRPO step seconds with / without mismatch metrics", m_on / m_off, None)
    engine.destroy()


if __name__ == "__main__":
    main()
