"""Fixtures for the embedded server tests: a tiny random Llama on disk, real
server processes, a small HTTP client, and the full in-memory weight update
sequence (``broadcast_update``) as the trainer side would run it."""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

ADMIN_TOKEN = "s3cret-test-token"


def make_tiny_llama(path: str, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        # No eos: generation lengths stay deterministic; stops are tested
        # through stop_token_ids.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    # Random init with std 0.02 makes every token look alike; a larger scale
    # gives greedy outputs that vary with the prompt and the weights.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tiny-llama"))
    make_tiny_llama(d)
    return d


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="session")
def hf_eager(tiny_model_dir):
    """The same model with eager attention: the forward again in another
    summation order, whose distance from ``hf_model`` is the noise floor of a
    server-vs-forward comparison (``areal_kernel.testing.noise``)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="session")
def servers(tiny_model_dir, tmp_path_factory):
    """Two fp32 servers with an admin token; stopped at the end of the session."""
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    cfg = EmbeddedServerConfig(dtype="float32", admin_token=ADMIN_TOKEN, max_batch_size=64)
    launcher = EmbeddedLauncher(cfg, run_dir=str(tmp_path_factory.mktemp("embedded-run")))
    try:
        infos = launcher.launch(tiny_model_dir, n_servers=2, devices_per_server=0)
        yield [Client(i.address) for i in infos]
    finally:
        launcher.stop()
    # stop() must take the whole process group down (checked on teardown).
    for info in infos:
        with pytest.raises(ProcessLookupError):
            os.killpg(info.pid, 0)


class Client:
    """Minimal synchronous JSON client (stdlib only)."""

    def __init__(self, address: str, token: str | None = ADMIN_TOKEN) -> None:
        self.address = address
        self.token = token

    def call(self, path: str, body: Any = None, token: str | None = "default", timeout: float = 120) -> tuple[int, Any]:
        tok = self.token if token == "default" else token
        headers = {"Content-Type": "application/json"}
        if tok:
            headers["Authorization"] = f"Bearer {tok}"
        get = path in ("/health", "/info")
        data = None if get else json.dumps({} if body is None else body).encode()
        req = urllib.request.Request(f"http://{self.address}{path}", data=data, headers=headers, method="GET" if get else "POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def ok(self, path: str, body: Any = None) -> Any:
        status, out = self.call(path, body)
        assert status == 200, (path, status, out)
        return out

    def generate(self, rid: str, input_ids: list[int], **sp: Any) -> dict:
        return self.ok("/generate", {"rid": rid, "input_ids": input_ids, "sampling_params": sp})

    def info(self) -> dict:
        return self.ok("/info")

    def wait_for(self, pred, what: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if pred(info):
                return info
            assert time.monotonic() < deadline, f"timed out waiting for {what}; last /info: {info}"
            time.sleep(0.01)


def broadcast_update(
    clients: list[Client],
    named: list[tuple[str, Any]],
    version: int,
    bucket_bytes: int = 64 << 10,
    group_name: str = "areal-test",
) -> list[dict]:
    """The full in-memory weight update, trainer side (this process = rank 0):

    1. pick a rendezvous port; ask every server to join ``/init_weights_group``
       (ranks 1..n) *while* this process joins as rank 0 (the call blocks
       until all ranks are in);
    2. post ``/update_weights_from_distributed`` with the tensor metadata to
       every server *while* ``send_buckets`` broadcasts the bytes;
    3. each server answers once its copy is in the model and the version set.
    """
    from areal_kernel.utils.network import reserve_port
    from areal_kernel.weights.broadcast import send_buckets, tensor_meta

    with reserve_port() as reserved:  # held until this process's store listens on it
        group = _join_as_rank_0(clients, reserved.port, group_name)
    with ThreadPoolExecutor(len(clients)) as ex:
        meta = tensor_meta(named)
        updates = [
            ex.submit(c.ok, "/update_weights_from_distributed",
                      {"version": version, "tensors": meta, "bucket_bytes": bucket_bytes})
            for c in clients
        ]
        send_buckets(group, named, bucket_bytes)
        out = [u.result() for u in updates]
    group.destroy()
    return out


def _join_as_rank_0(clients: list[Client], port: int, group_name: str) -> Any:
    """Ask every server to join ranks 1..n while this process joins as rank 0."""
    from areal_kernel.weights.broadcast import init_weight_group

    world = 1 + len(clients)
    with ThreadPoolExecutor(len(clients)) as ex:
        joins = [
            ex.submit(
                c.ok,
                "/init_weights_group",
                {"master_addr": "127.0.0.1", "master_port": port, "world_size": world, "rank": i + 1,
                 "group_name": group_name, "backend": "gloo"},
            )
            for i, c in enumerate(clients)
        ]
        group = init_weight_group("127.0.0.1", port, world, 0, group_name, backend="gloo", timeout_s=60)
        for j in joins:
            j.result()
    return group


@pytest.fixture
def client_for():
    """Build a client for an address (with or without the admin token)."""
    return Client


@pytest.fixture
def bcast():
    return broadcast_update
