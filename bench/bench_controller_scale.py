"""What one controller process can drive: episodes/s through the rollout
executor and the remote-inference client, controller CPU per request,
memory per in-flight rollout, and the time to fan a pause / weight update /
resume out to N servers, for N = 8, 32, 128, 512.

    OMP_NUM_THREADS=1 python bench/bench_controller_scale.py [--servers 8 32 128 512]
        [--per-process 64] [--tokens 32] [--rate 200] [--concurrency 512] [--seconds 4]
        [--profile OUT.prof]

The servers are stand-ins: small aiohttp servers, many per process, that
speak the embedded backend's wire format (``/generate``, ``/pause``,
``/resume``, ``/update_weights_from_disk``, ``/health``) and produce
``--tokens`` tokens per request at ``--rate`` tokens/s per request (a pause
with ``mode=abort`` returns the tokens produced so far, like a real server).
They cost no model time, so what is measured is the controller: the
kernel's ``RolloutExecutor`` running a one-request-per-episode workflow
through ``RemoteInferenceEngine`` with ``EmbeddedProtocol`` -- no tokenizer,
no reward processes (those scale out of the controller already).

The controller is pinned to one core and the servers to the other(s), so
"episodes/s" is what one controller core sustains (unless the servers' core
saturates first: the table shows the servers' CPU share too). Fan-out is the
wall time of ``pause()``, ``update_weights(disk)`` and ``resume()`` on the
client while rollouts run (median of 5), and the controller CPU they took.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import statistics
import subprocess
import sys
import time

from summary import report  # bench/summary.py: one table of ratios for `make bench`

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- the stand-in servers (run with --serve in their own processes) ---------------------------------
class StandIn:
    """One stand-in server's state: paused or not, weight version, running requests."""

    def __init__(self, tokens: int, rate: float) -> None:
        self.tokens = tokens
        self.rate = rate
        self.version = 0
        self.running = asyncio.Event()
        self.running.set()
        self.abort = asyncio.Event()


def stand_in_app(s: StandIn):
    from aiohttp import web

    async def health(_):
        return web.json_response({"ok": True})

    async def generate(request):
        body = await request.json()
        want = min(int(body["sampling_params"]["max_new_tokens"]), s.tokens)
        await s.running.wait()  # requests arriving while paused are queued
        start = time.monotonic()
        abort = s.abort
        try:
            await asyncio.wait_for(abort.wait(), timeout=want / s.rate)
            done = min(want, int((time.monotonic() - start) * s.rate))
            reason = "abort"
        except asyncio.TimeoutError:
            done, reason = want, "length"
        base = len(body["input_ids"])
        return web.json_response(
            {
                "output_ids": [(base + i) % 1000 for i in range(done)],
                "output_logprobs": [-0.5] * done,
                "finish_reason": reason,
                "weight_version": s.version,
            }
        )

    async def pause(request):
        s.running.clear()
        if (await request.json()).get("mode", "abort") == "abort":
            s.abort.set()
            s.abort = asyncio.Event()  # the next generations wait on a fresh one
        return web.json_response({"paused": True})

    async def resume(_):
        s.running.set()
        return web.json_response({"paused": False})

    async def update(request):
        s.version = int((await request.json())["version"])
        return web.json_response({"version": s.version})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_post("/update_weights_from_disk", update)
    return app


async def serve(n: int, tokens: int, rate: float) -> None:
    from aiohttp import web

    runners = []
    ports = []
    for _ in range(n):
        runner = web.AppRunner(stand_in_app(StandIn(tokens, rate)), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        ports.append(site._server.sockets[0].getsockname()[1])  # noqa: SLF001 -- port 0 -> the bound one
        runners.append(runner)
    print(" ".join(map(str, ports)), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for r in runners:
        await r.cleanup()


def start_servers(total: int, per_process: int, tokens: int, rate: float, cores: set[int]) -> tuple[list, list[str]]:
    procs, addresses = [], []
    for i in range(0, total, per_process):
        n = min(per_process, total - i)
        p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", str(n), "--tokens", str(tokens), "--rate", str(rate)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )
        procs.append(p)
    for p in procs:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("a stand-in server process died before listening")
        addresses += [f"127.0.0.1:{port}" for port in line.split()]
    return procs, addresses


def stop_servers(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def proc_cpu(pids: list[int]) -> float:
    """User+system CPU seconds of the given processes (Linux /proc)."""
    tot = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            tot += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return tot


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# -- the controller side --------------------------------------------------------------------------
class OneRequestEpisode:
    """An episode = one generation request -> one trajectory (reward inline):
    the kernel's own path (executor -> client -> HTTP) with nothing else in it."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    async def arun_episode(self, engine, record):
        from areal_kernel.api.io import GenerationConfig, ModelRequest, Trajectory, TrajectoryGroup

        prompt = record["prompt_ids"]
        resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=GenerationConfig(max_new_tokens=self.tokens)))
        n = len(resp.output_ids)
        traj = Trajectory(
            input_ids=prompt + resp.output_ids,
            loss_mask=[0] * len(prompt) + [1] * n,
            logprobs=[0.0] * len(prompt) + resp.output_logprobs,
            versions=[-1] * len(prompt) + resp.output_versions,
            reward=float(n % 2),
        )
        return TrajectoryGroup([traj], group_id=str(record["id"]))


def make_engine(addresses: list[str]):
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol

    return RemoteInferenceEngine(addresses, EmbeddedProtocol(), request_timeout_s=120.0)


def make_executor(engine, tokens: int, concurrency: int):
    from areal_kernel.rollout.executor import RolloutExecutor

    counter = iter(range(10**9))
    prompt = list(range(1, 65))  # a 64-token prompt

    def next_record():
        i = next(counter)
        return {"id": i, "prompt_ids": prompt}

    # Staleness is not what is measured: a budget that never binds.
    return RolloutExecutor(
        engine, OneRequestEpisode(tokens), next_record, batch_size=64, max_staleness=10**6, max_concurrent=concurrency
    )


def consume(ex, seconds: float) -> int:
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        n += len(ex.get_batch(64, timeout=60))
    return n


def fan_out(engine, version: int) -> tuple[float, float, float, float]:
    """Wall seconds of pause, update (disk), resume on every server, and the controller CPU they took."""
    from areal_kernel.api.engine import WeightUpdateMeta

    c = time.process_time()
    t0 = time.monotonic()
    engine.pause()
    t1 = time.monotonic()
    engine.update_weights(WeightUpdateMeta(kind="disk", path="/nonexistent/weights", version=version))
    t2 = time.monotonic()
    engine.resume()
    t3 = time.monotonic()
    return t1 - t0, t2 - t1, t3 - t2, time.process_time() - c


def throughput(addresses, server_pids, args) -> dict:
    engine = make_engine(addresses)
    # Control alone first (no rollouts running): the control plane's own cost.
    idle = [fan_out(engine, v) for v in range(1, 4)]
    ex = make_executor(engine, args.tokens, args.concurrency)
    if args.profile:
        _profile_rollout_thread(ex, args.profile)
    ex.start()
    consume(ex, 1.5)  # warm up: connections, pools, thread start
    r0 = engine.stats["requests"]
    c0, s0, w0 = time.process_time(), proc_cpu(server_pids), time.monotonic()
    eps = consume(ex, args.seconds)
    wall = time.monotonic() - w0
    cpu, scpu = time.process_time() - c0, proc_cpu(server_pids) - s0
    reqs = engine.stats["requests"] - r0
    # Fan-out while rollouts run (the pause aborts them; they resume after).
    fan = {"pause": [], "update": [], "resume": [], "cpu": []}
    for v in range(4, 9):
        for k, x in zip(("pause", "update", "resume", "cpu"), fan_out(engine, v)):
            fan[k].append(x)
        ex.set_version(v)
        consume(ex, 0.3)
    ex.stop()
    engine.destroy()
    med = {k: statistics.median(v) for k, v in fan.items()}
    return {
        "eps": eps / wall,
        "cpu_ms_per_req": 1000 * cpu / max(1, reqs),
        "ctl_cpu": cpu / wall,
        "srv_cpu": scpu / wall,
        "pause_ms": 1000 * med["pause"],
        "update_ms": 1000 * med["update"],
        "resume_ms": 1000 * med["resume"],
        "fan_ms": 1000 * (med["pause"] + med["update"] + med["resume"]),
        "fan_cpu_ms": 1000 * med["cpu"],
        "interruptions": engine.stats["interruptions"],
        "idle_fan_ms": 1000 * statistics.median(sum(x[:3]) for x in idle),
        "idle_fan_cpu_ms": 1000 * statistics.median(x[3] for x in idle),
    }


def memory_per_rollout(addresses, inflight: int) -> float:
    """Controller RSS growth per rollout held in flight (servers answer slowly)."""
    import gc

    engine = make_engine(addresses)
    ex = make_executor(engine, 10**6, inflight)  # the slow servers never finish in the window
    gc.collect()
    base = rss_mb()
    ex.start()
    deadline = time.monotonic() + 60
    while ex.budget.running < inflight and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # every request on the wire
    gc.collect()
    grown = rss_mb() - base
    running = ex.budget.running
    engine.pause()  # abort them so the executor stops promptly
    ex.stop(timeout=30)
    engine.destroy()
    return 1024 * grown / max(1, running)


def _profile_rollout_thread(ex, out: str) -> None:
    import cProfile

    main = ex._thread_main  # noqa: SLF001 -- the bench profiles the executor's own thread

    def profiled():
        prof = cProfile.Profile()
        prof.enable()
        try:
            main()
        finally:
            prof.disable()
            prof.dump_stats(out)

    ex._thread_main = profiled  # noqa: SLF001


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--servers", type=int, nargs="+", default=[8, 32, 128, 512])
    ap.add_argument("--per-process", type=int, default=64, help="stand-in servers per process")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per request")
    ap.add_argument("--rate", type=float, default=200.0, help="tokens/s per request")
    ap.add_argument("--concurrency", type=int, default=512, help="rollouts in flight (executor max_concurrent)")
    ap.add_argument("--seconds", type=float, default=4.0, help="measurement window per row")
    ap.add_argument("--memory-inflight", type=int, default=1024)
    ap.add_argument("--profile", default="", help="cProfile the rollout thread of the last row into this file")
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.tokens, args.rate))
        return 0

    cores = sorted(os.sched_getaffinity(0))
    ctl_core = {cores[0]}
    srv_cores = set(cores[1:]) or ctl_core
    os.sched_setaffinity(0, ctl_core)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    total = max(args.servers)
    print(f"controller on core {sorted(ctl_core)}, {total} stand-in servers on cores {sorted(srv_cores)} "
          f"({args.per_process} per process); {args.tokens} tokens/request at {args.rate:g} tok/s; "
          f"{args.concurrency} rollouts in flight", flush=True)
    procs, addresses = start_servers(total, args.per_process, args.tokens, args.rate, srv_cores)
    pids = [p.pid for p in procs]
    rows = []
    try:
        profile = args.profile
        for i, n in enumerate(sorted(args.servers)):
            args.profile = profile if i == len(args.servers) - 1 else ""
            r = throughput(addresses[:n], pids, args)
            r["n"] = n
            rows.append(r)
            print(f"  N={n}: {r['eps']:.0f} episodes/s, fan-out {r['fan_ms']:.0f} ms", flush=True)
    finally:
        stop_servers(procs)
    # Memory: slow servers so every rollout stays in flight.
    procs, addresses = start_servers(min(total, 64), args.per_process, 10**6, 1.0, srv_cores)
    try:
        mem_kb = memory_per_rollout(addresses, args.memory_inflight)
    finally:
        stop_servers(procs)

    hdr = ("| servers N | episodes/s | controller CPU ms/request | controller core busy | servers' CPU "
           "| pause ms | update ms | resume ms | fan-out total ms | fan-out controller CPU ms "
           "| idle fan-out ms | idle fan-out CPU ms |")
    print()
    print(hdr)
    print("|---:" * (hdr.count("|") - 1) + "|")
    for r in rows:
        print(f"| {r['n']} | {r['eps']:.0f} | {r['cpu_ms_per_req']:.3f} | {100 * r['ctl_cpu']:.0f}% "
              f"| {100 * r['srv_cpu']:.0f}% | {r['pause_ms']:.0f} | {r['update_ms']:.0f} | {r['resume_ms']:.0f} "
              f"| {r['fan_ms']:.0f} | {r['fan_cpu_ms']:.0f} | {r['idle_fan_ms']:.0f} | {r['idle_fan_cpu_ms']:.0f} |")
    print(f"\nmemory per in-flight rollout: {mem_kb:.1f} KiB ({args.memory_inflight} in flight, 64-token prompts)")
    big = max(rows, key=lambda r: r["n"])
    report("controller episodes/s on one core / 1000", min(r["eps"] for r in rows) / 1000.0, 1.0)
    report(f"fan-out pause+update+resume to {big['n']} servers, s", big["fan_ms"] / 1000.0, 1.0,
           higher_is_better=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
