"""Weight-update latency, disk (safetensors save + server reload) vs in-memory
broadcast (gloo), for SmolLM2-135M into one embedded server.

    .venv/bin/python bench/bench_weight_update.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
    from areal_kernel.models.resolve import resolve_model_path
    from areal_kernel.trainer.weight_sync import BroadcastTransport, DiskTransport

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    model_dir = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory() as run_dir:
        launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=run_dir)
        try:
            infos = launcher.launch(model_dir, n_servers=1, devices_per_server=0)
            client = RemoteInferenceEngine([i.address for i in infos], EmbeddedProtocol())
            engine = TorchTrainEngine({"lr": 1e-6})
            engine.initialize(model_dir, 10)
            rows = []
            for cls in (DiskTransport, BroadcastTransport):
                t = cls(engine, client, run_dir, 256 << 20)
                t.setup()
                times, mb = [], 0.0
                for v in range(1, args.repeats + 1):
                    t0 = time.monotonic()
                    m = t.update(v)
                    times.append(time.monotonic() - t0)
                    mb = m["weights/mb"]
                med = statistics.median(times)
                rows.append((cls.name, med, mb, mb / med, m.get("weights/pause_s", 0.0)))
        finally:
            launcher.stop()
    print("\n| transport | seconds (median) | MB | MB/s | servers paused s |")
    print("|---|---|---|---|---|")
    for name, s, mb, rate, pause in rows:
        print(f"| {name} | {s:.2f} | {mb:.0f} | {rate:.0f} | {pause:.2f} |")
    print(f"\ndisk / broadcast latency ratio: {rows[0][1] / rows[1][1]:.2f}")
    report("embedded weight update: disk / broadcast seconds", rows[0][1] / rows[1][1])


if __name__ == "__main__":
    main()
