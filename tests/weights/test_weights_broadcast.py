"""plan_buckets by hand, and a real gloo broadcast to two receiver processes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from areal_kernel.errors import ConfigError
from areal_kernel.weights.broadcast import (
    init_weight_group,
    plan_buckets,
    send_buckets,
    tensor_meta,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _meta(*specs):
    return [{"name": f"t{i}", "dtype": d, "shape": s} for i, (d, s) in enumerate(specs)]


def test_plan_buckets_by_hand():
    # Aligned sizes (64 B): 40 B -> 64, 100 B -> 128, 8 B -> 64, 400 B -> 448, 4 B -> 64
    meta = _meta(("float32", [10]), ("float32", [25]), ("bfloat16", [4]), ("float32", [100]), ("int32", [1]))
    # 64 + 128 + 64 = 256 fits exactly; 448 is alone (over the limit); 64 starts a new bucket.
    assert plan_buckets(meta, 256) == [[0, 1, 2], [3], [4]]
    # With 255: 64 + 128 = 192, +64 > 255 -> new bucket.
    assert plan_buckets(meta, 255) == [[0, 1], [2], [3], [4]]


def test_plan_buckets_exact_fit_and_oversize():
    meta = _meta(("float32", [16]), ("float32", [16]), ("float32", [16]), ("float32", [16]))  # 64 B each
    assert plan_buckets(meta, 128) == [[0, 1], [2, 3]]
    assert plan_buckets(meta, 127) == [[0], [1], [2], [3]]
    big = _meta(("float32", [16]), ("float32", [1000]), ("float32", [16]))  # 64, 4000, 64
    assert plan_buckets(big, 256) == [[0], [1], [2]]  # the big one alone, over the limit
    assert plan_buckets(big, 1 << 20) == [[0, 1, 2]]
    assert plan_buckets(_meta(("float32", [0]), ("float32", [2])), 64) == [[0, 1]]
    with pytest.raises(ConfigError, match="bucket_bytes"):
        plan_buckets(big, 0)


def test_plan_is_deterministic_and_covers_all():
    meta = _meta(*[("bfloat16", [i % 7 + 1, 3]) for i in range(50)])
    a = plan_buckets(meta, 200)
    assert a == plan_buckets([dict(m) for m in meta], 200)
    assert [i for b in a for i in b] == list(range(50))


def test_tensor_meta():
    m = tensor_meta([("x", torch.zeros(2, 3, dtype=torch.bfloat16)), ("y", torch.zeros(4, dtype=torch.int64))])
    assert m == [{"name": "x", "dtype": "bfloat16", "shape": [2, 3]}, {"name": "y", "dtype": "int64", "shape": [4]}]


def _tensors():
    g = torch.Generator().manual_seed(3)
    return [
        ("w.a", torch.randn(33, 7, generator=g)),
        ("w.b", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("w.c", torch.arange(-50, 50, dtype=torch.int64)),
        ("w.big", torch.randn(300, 40, generator=g)),  # 48 kB: bigger than the bucket
        ("w.flag", torch.tensor([True, False, False, True])),
        ("w.empty", torch.zeros(0, 3)),
        ("w.last", torch.randn(2, 2, generator=g).half()),
    ]


def test_broadcast_to_two_receivers_while_default_group_exists(tmp_path):
    import torch.distributed as dist

    from areal_kernel.inference.embedded.ports import find_free_port

    # The "trainer" already has a default group: the weight group must not disturb it.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    try:
        port = find_free_port()
        named = _tensors()
        meta = tensor_meta(named)
        bucket = 4096
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        procs = [
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "recv_worker.py"), str(port), str(r), "3", str(bucket),
                 str(tmp_path / f"rank{r}")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for r in (1, 2)
        ]
        try:
            group = init_weight_group("127.0.0.1", port, 3, 0, "test-weights", backend="gloo", timeout_s=60)
            sent_meta = send_buckets(group, named, bucket)
            assert sent_meta == meta
            group.destroy()
            for p in procs:
                out, _ = p.communicate(timeout=60)
                assert p.returncode == 0, out.decode()
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
        assert dist.get_world_size() == 1 and dist.get_rank() == 0
        t = torch.ones(2)
        dist.all_reduce(t)  # the default group still works
        assert torch.equal(t, torch.ones(2))
    finally:
        dist.destroy_process_group()

    from areal_kernel.weights.disk import load_state_dict_dir

    for r in (1, 2):
        got = load_state_dict_dir(str(tmp_path / f"rank{r}"))
        assert set(got) == {n for n, _ in named}
        for name, t in named:
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name], t), name


def test_group_argument_errors():
    with pytest.raises(ConfigError, match="world_size"):
        init_weight_group("127.0.0.1", 1, 1, 0, "g")
    with pytest.raises(ConfigError, match="rank"):
        init_weight_group("127.0.0.1", 1, 2, 2, "g")
    with pytest.raises(ConfigError, match="backend"):
        from areal_kernel.inference.embedded.ports import find_free_port

        init_weight_group("127.0.0.1", find_free_port(), 2, 0, "g", backend="nosuchbackend", timeout_s=5)
