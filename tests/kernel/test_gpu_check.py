"""bench/gpu_check.sh and its driver without a GPU: they parse, fail in
seconds with one clear line (exit 2) instead of a traceback, run a section
end to end on the cpu platform, and the contract suite they run on the device
collects the number of tests the driver expects. The full CPU smoke run of
every section (``python bench/gpu_check.py --device cpu --tiny``, ~6 minutes
on 2 shared cores) is not part of the suite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _no_gpu_env(tmp_path: Path) -> dict[str, str]:
    # An empty CUDA_VISIBLE_DEVICES hides every GPU, so this holds on a GPU machine too.
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", GPU_CHECK_LOG_DIR=str(tmp_path / "logs"),
                GPU_CHECK_WORK=str(tmp_path / "work"), OMP_NUM_THREADS="1")  # fmt: skip


def test_scripts_parse():
    for name in ("gpu_check.sh", "gpu_prepare.sh"):
        proc = subprocess.run(["bash", "-n", str(BENCH / name)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, (name, proc.stderr)


def test_shell_script_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(["bash", str(BENCH / "gpu_check.sh")], capture_output=True, text=True, timeout=60,
                          env=_no_gpu_env(tmp_path), cwd=str(tmp_path))  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: FAIL: no CUDA device"), proc.stderr
    assert "--device cpu --tiny" in lines[0]  # says what can run instead


def test_driver_without_a_gpu_names_the_sections_not_run(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py")], capture_output=True, text=True, timeout=120,
                          env=_no_gpu_env(tmp_path))  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    first, second = proc.stderr.strip().splitlines()
    assert first.startswith("gpu_check: FAIL: no usable cuda device here: AREAL_PLATFORM='cuda' is not usable")
    assert second.startswith("gpu_check: 14 section(s) not run: env, platform-suite, parity,")


def test_unknown_section_is_named(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--only", "env,nope"], capture_output=True,
                          text=True, timeout=120, env=_no_gpu_env(tmp_path))  # fmt: skip
    assert proc.returncode == 2
    assert "unknown section(s) ['nope']; sections: ['env', 'platform-suite'," in proc.stderr


def test_a_section_runs_end_to_end_on_the_cpu_platform(tmp_path):
    """``env`` on ``--device cpu``: the section process, its result file, the
    PASS line and the closing table (the doctor must select cpu here)."""
    env = _no_gpu_env(tmp_path)
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--device", "cpu", "--tiny", "--only", "env"],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^PASS  env .* doctor selects 'cpu'$", proc.stdout, re.MULTILINE), proc.stdout
    assert "| section | result | s | key numbers |" in proc.stdout
    (row,) = json.loads((tmp_path / "logs" / "gpu_check.json").read_text())
    assert row["name"] == "env" and row["status"] == "PASS"
    assert row["numbers"]["selected"] == "cpu" and row["numbers"]["bf16_matmul_tflops"] > 0
    assert "===== env:" in (tmp_path / "logs" / "gpu_check.log").read_text()


def test_the_device_suite_collects_what_the_driver_expects(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        env = dict(os.environ, AREAL_GPU_CHECK_PLATFORM="cpu", OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-m", "pytest", str(BENCH / "gpu_suite.py"), "--co", "-q",
                               "-p", "no:cacheprovider", "-o", "addopts="],
                              capture_output=True, text=True, timeout=120, env=env, cwd=str(REPO))  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        collected = [ln for ln in proc.stdout.splitlines() if "::" in ln]
        text = (BENCH / "gpu_suite.py").read_text()
        expected = int(re.search(r"^SUITE_TESTS = (\d+)$", text, re.MULTILINE).group(1))
        assert len(collected) == expected
    finally:
        sys.path.remove(str(BENCH))


def test_model_flops_count_every_matmul_weight_of_qwen2_1_5b():
    """The MFU numerator: 6 x the matmul weights of the Qwen2-1.5B shape must
    be 6 x its parameter count, less only biases and norms (< 0.05%), and the
    config must be Qwen2-1.5B's 1.54B parameters."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(BENCH))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCH))
    cfg = gpu_check.QWEN2_1_5B
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    n_params = sum(p.numel() for p in model.parameters())
    assert 1.54e9 < n_params < 1.55e9
    seq = 2048
    attention = 6.0 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq
    matmul_weights = (gpu_check._flops_per_token(cfg, seq) - attention) / 6
    assert 0 < n_params - matmul_weights < 5e-4 * n_params
