"""Cost of the weight-delivery check (``monitor.weights``) per weight update,
as a fraction of the update's own time: SmolLM2-135M, the torch train engine,
one embedded server, disk and broadcast updates, the check with its default
sample (40 tensors x 64 elements per update, every tensor within 7 updates).

    .venv/bin/python bench/bench_weight_check.py [--repeats 5] [--server-dtype float32]

Goal: the check costs under 5% of the update (disk, the CPU default).
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
    from areal_kernel.config.monitor import WeightsMonitorConfig
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
    from areal_kernel.models.resolve import resolve_model_path
    from areal_kernel.monitor.weights import WeightsMonitor, rotation_period
    from areal_kernel.trainer.weight_sync import BroadcastTransport, DiskTransport

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--server-dtype", default="float32")
    ap.add_argument("--tensors-per-update", type=int, default=None, help="default: monitor.weights' default")
    args = ap.parse_args()
    model_dir = resolve_model_path(args.model)
    defaults = WeightsMonitorConfig()
    if args.tensors_per_update is not None:
        defaults = defaults.model_copy(update={"tensors_per_update": args.tensors_per_update})
    rows = []
    with tempfile.TemporaryDirectory() as run_dir:
        launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype=args.server_dtype), run_dir=run_dir)
        try:
            infos = launcher.launch(model_dir, n_servers=1, devices_per_server=0)
            client = RemoteInferenceEngine([i.address for i in infos], EmbeddedProtocol())
            # The servers' part of the check (HTTP round trip and their fingerprint), timed apart.
            server_s: list[float] = []
            ask = client.weight_fingerprints

            def timed_ask(spec: dict) -> tuple:
                t = time.monotonic()
                try:
                    return ask(spec)
                finally:
                    server_s.append(time.monotonic() - t)

            client.weight_fingerprints = timed_ask  # type: ignore[method-assign]
            engine = TorchTrainEngine({"lr": 1e-6})
            engine.initialize(model_dir, 10)
            n_tensors = len(engine.named_weights_for_transfer())
            version = 0
            for cls in (DiskTransport, BroadcastTransport):
                t = cls(engine, client, run_dir, 256 << 20)
                t.setup()
                mon = WeightsMonitor(
                    action="error",
                    tensors_per_update=defaults.tensors_per_update,
                    elements_per_tensor=defaults.elements_per_tensor,
                )
                updates, checks = [], []
                server_s.clear()
                for _ in range(args.repeats):
                    version += 1
                    t0 = time.monotonic()
                    t.update(version)
                    t1 = time.monotonic()
                    out = mon.check(version, engine, client)
                    t2 = time.monotonic()
                    mon.raise_if_alarmed()  # the bench's weights must check clean
                    assert out["weights_mismatch"] == 0 and out["weights_checked"] > 0, out
                    updates.append(t1 - t0)
                    checks.append(t2 - t1)
                u, c = statistics.median(updates), statistics.median(checks)
                rows.append((cls.name, u, c, statistics.median(server_s), c / u, int(out["weights_checked"])))
                t.close()
        finally:
            launcher.stop()
    k = rotation_period(n_tensors, defaults.tensors_per_update)
    print(
        f"\n{args.model}, {n_tensors} tensors, server {args.server_dtype}; check: "
        f"{defaults.tensors_per_update} tensors x {defaults.elements_per_tensor} elements per update "
        f"(every tensor within {k} updates); median of {args.repeats}"
    )
    print("\n| transport | update s | check s | of which the server's answer s | check / update | tensors checked |")
    print("|---|---|---|---|---|---|")
    for name, u, c, srv, ratio, n in rows:
        print(f"| {name} | {u:.3f} | {c:.4f} | {srv:.4f} | {100 * ratio:.2f}% | {n} |")
    report("weight-delivery check / disk weight update seconds", rows[0][4], 0.05, higher_is_better=False)
    report("weight-delivery check / broadcast weight update seconds", rows[1][4], 0.05, higher_is_better=False)


if __name__ == "__main__":
    main()
