"""Start-up of the kernel's own processes, fresh interpreter vs prefork server
(``areal_kernel.utils.prefork``): the time from ``launch`` to a healthy
embedded server (a tiny random Llama, so the model load is negligible next
to the interpreter's), and of a program that imports torch and
transformers' Llama and exits (what every server and rank starts with). Alternating fresh and
preforked starts, median of each.

    .venv/bin/python bench/bench_prefork.py [--repeats 5]

Goal: a preforked embedded server is healthy at least 2x sooner.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Imports torch and transformers (as every server and rank does) and exits:
# the module has no main, so running it only imports it.
PROGRAM = ["-m", "transformers.models.llama.modeling_llama"]


def _server_start(model_dir: str, run_dir: str) -> float:
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    launcher = EmbeddedLauncher(EmbeddedServerConfig(), run_dir=run_dir)
    t0 = time.perf_counter()
    try:
        launcher.launch(model_dir, n_servers=1, devices_per_server=0)
        return time.perf_counter() - t0
    finally:
        launcher.stop()


def _program_run() -> float:
    from areal_kernel.utils import prefork

    t0 = time.perf_counter()
    prefork.run([sys.executable, *PROGRAM], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    from areal_kernel.testing.models import make_tiny_llama
    from areal_kernel.utils import prefork

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_llama(os.path.join(tmp, "tiny"), seed=0)
        server = prefork.start_server(tmp)
        times: dict[tuple[str, str], list[float]] = {}
        try:
            for i in range(args.repeats):
                for mode in ("fresh", "preforked"):
                    if mode == "preforked":
                        os.environ[prefork.PREFORK_ENV] = server.socket_path
                    else:
                        os.environ.pop(prefork.PREFORK_ENV, None)
                    run_dir = os.path.join(tmp, f"run-{mode}-{i}")
                    times.setdefault(("embedded server healthy", mode), []).append(_server_start(model_dir, run_dir))
                    times.setdefault(("program import + exit", mode), []).append(_program_run())
        finally:
            os.environ.pop(prefork.PREFORK_ENV, None)
            server.stop()
    print(f"\n{'what':28} {'fresh s':>9} {'preforked s':>12} {'ratio':>7}")
    ratios = {}
    for what in ("embedded server healthy", "program import + exit"):
        fresh = statistics.median(times[(what, "fresh")])
        pre = statistics.median(times[(what, "preforked")])
        ratios[what] = fresh / pre
        print(f"{what:28} {fresh:9.2f} {pre:12.2f} {fresh / pre:6.2f}x")
    report("embedded server start: fresh / preforked (time to healthy)", ratios["embedded server healthy"], 2.0)
    report("torch+transformers program run: fresh / preforked", ratios["program import + exit"])


if __name__ == "__main__":
    main()
