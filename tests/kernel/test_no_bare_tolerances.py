"""Float comparisons in the test suite use no bare tolerance constant where
two code paths meet: a difference between two engines, processes, servers
or kernels is compared against a noise floor measured in the same test
(``areal_kernel.testing.noise``), never against a constant such as ``1e-5``.

Why: how far two float paths land apart depends on the CPU (AVX2 and
AVX-512 sum in other orders, and training steps amplify the difference), so a
constant that passes on one CI machine fails on the other, or is so loose it
would hide a bug. Comparisons that stay bare are listed below with the reason:
hand-computed values of a formula, the same code run twice (resume/replay
determinism), or a cross-implementation comparison with no same-path floor,
with its measured value.

Every file's count of bare tolerances must equal its entry: a new one fails
(use the helper, or add it here with a reason), and a removed one must be
taken off (a stale count would let a later one in unseen).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE_CUTOFF = 1e-2  # a constant at or below this in a comparison reads as a tolerance
_CLOSE_CALLS = {"allclose", "isclose", "assert_close", "assert_allclose"}

HAND = "hand-computed values of a formula on hand-made inputs (one code path, a known answer)"
SAME = "the same code path run twice (save/load or kill/resume against an uninterrupted run; one server, same weights)"
BOUND = "a bound on one value (a logprob is <= 0, a sign), not two paths compared"
VLLM = (
    "vLLM's own CPU kernels against the torch engine's recompute: no same-path floor exists for vLLM here (one "
    "build, no second summation order to run it in). Measured: fp32 vLLM vs HF within 1e-4 on SmolLM2 (1e-3 keeps "
    "10x of it); a stale or wrong weight moves logprobs by > 1e-2"
)
# path -> (number of bare tolerances in it, why they stay bare)
ALLOWED: dict[str, tuple[int, str]] = {
    "tests/algo/test_advantages.py": (3, HAND),
    "tests/algo/test_grpo.py": (3, HAND),
    "tests/algo/test_estimators.py": (1, HAND),
    "tests/monitor/test_mismatch.py": (1, HAND + ": k3 of a hand-made 1e-4 log-prob gap against its d^2/2 expansion"),
    "tests/algo/test_losses.py": (18, HAND),
    "tests/algo/test_loss_variants.py": (12, HAND),
    "tests/inference/test_embedded_sampling.py": (2, HAND + ": logprobs of hand-made logits"),
    "tests/kernel/test_noise.py": (3, HAND + ": the noise helper's own arithmetic"),
    "tests/offline/test_offline_losses.py": (1, HAND + ": an SFT loss split in two vs whole, on 7 hand-made logprobs"),
    "tests/offline/test_trainers_learn.py": (
        2, HAND + ": the NLL logged twice (same number), and a DPO margin of 0 when policy and reference are one model"
    ),
    "areal_kernel/testing/contracts/metric_sink.py": (4, HAND + ": a fake trainer's known metrics"),
    "areal_kernel/testing/contracts/advantage_estimator.py": (
        3, HAND + ": estimator advantages of hand-made rewards (0 for equal rewards, invariance to renaming/reordering)"
    ),
    "areal_kernel/testing/contracts/loss.py": (
        6, HAND + ": a loss on hand-made tensors split into micro-batches vs whole; and " + BOUND
    ),
    "tests/engine/test_torch_engine.py": (2, "the clipped norm recomputed by hand from the gradients (" + HAND + "); "
                                          "save/load continuing exactly (" + SAME + ")"),  # fmt: skip
    "areal_kernel/testing/contracts/inference_engine.py": (
        2, SAME + ": a server reloaded with its first weights; and " + BOUND
    ),
    "areal_kernel/testing/contracts/train_engine.py": (4, SAME + ": save_state/load_state; and " + BOUND),
    "tests/kernel/test_gpu_check.py": (1, HAND + ": the GPU check's parameter count against Qwen2-1.5B's published size"),
    "areal_kernel/testing/rank_engines.py": (
        2, SAME + ": StateRoundTrip, the FSDP (DCP) and Megatron (dist_checkpointing) parity files' "
        "save -> load -> the same two steps"
    ),
    "tests/inference/test_embedded_engine.py": (1, "a sampling frequency (0.5 +- 0.01 over many seeded draws), not two paths"),
    "tests/inference/test_remote_client.py": (
        2,
        "which weights produced each token of a generation spanning an update: the same test asserts the other "
        "weights' logprobs are > 1e-2 away; the server vs HF forward at one version is on a floor above",
    ),
    "plugins/areal-vllm/tests/test_vllm_server.py": (
        12,
        VLLM + " (lines comparing vLLM to the engine, including which weights produced each token across an update); "
        "and " + SAME + " (one vLLM server: with/without a stop string, disk vs in-memory update of the same "
        "weights, the original weights restored)",
    ),
    "plugins/areal-vllm/tests/test_vllm_vlm.py": (2, VLLM + "; measured 0.0 on the tiny Idefics3 model"),
    "tests/vlm/test_vlm_shapes_learns.py": (
        1, "a coarse check of a whole run's plumbing (the image inputs reach the train engine: the first step's mean "
        "importance weight within 1e-3 of 1); server and engine logprobs on image prompts are compared on a measured "
        "floor in tests/vlm/test_vlm_embedded.py",
    ),
}


def _files() -> list[Path]:
    tests = [p for p in (ROOT / "tests").rglob("*.py")]
    plugins = [p for p in (ROOT / "plugins").glob("*/tests/**/*.py")]
    suites = [p for p in (ROOT / "areal_kernel" / "testing").rglob("*.py") if p.name != "noise.py"]
    return sorted(p for p in tests + plugins + suites if "plugin_packages" not in p.parts)


def _small_const(node: ast.AST) -> bool:
    """A numeric constant in (0, TOLERANCE_CUTOFF], or a product with one (``1e-6 * max(1, x)``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return 0 < node.value <= TOLERANCE_CUTOFF
    if isinstance(node, ast.UnaryOp):
        return False
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _small_const(node.left) or _small_const(node.right)
    return False


def _tol_name(node: ast.AST) -> bool:
    """A module constant named like a tolerance (``TOL``, ``LOGPROB_TOL``)."""
    return isinstance(node, ast.Name) and (node.id == "TOL" or node.id.endswith("_TOL"))


def find_bare_tolerances(path: Path, rel: str | None = None) -> list[str]:
    rel = rel or path.relative_to(ROOT).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
        hit = False
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Lt, ast.LtE)) for op in node.ops):
            hit = any(_small_const(c) or _tol_name(c) for c in node.comparators)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            kws = {k.arg for k in node.keywords}
            if name == "approx":
                hit = bool(kws & {"abs", "rel"})
            elif name in _CLOSE_CALLS:
                hit = True  # their default tolerances are constants too
        if hit:
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:120]}")
    return found


def test_the_scan_sees_the_suite_and_the_contract_suites():
    files = {p.relative_to(ROOT).as_posix() for p in _files()}
    assert "plugins/areal-megatron/tests/megatron_helpers.py" in files
    assert "plugins/areal-fsdp/tests/test_fsdp_parity.py" in files
    assert "areal_kernel/testing/contracts/train_engine.py" in files and "areal_kernel/testing/noise.py" not in files


def test_the_scan_catches_what_it_forbids(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(a, b, torch, pytest):\n"
        "    assert abs(a - b) < 1e-5\n"
        "    assert abs(a - b) <= 1e-6 * max(1.0, abs(b))\n"
        "    assert torch.allclose(a, b, atol=1e-6)\n"
        "    assert a == pytest.approx(b, rel=1e-5)\n"
        "    assert diff(a, b) < TOL\n"
        "    torch.testing.assert_close(a, b)\n"
        "    assert a > 1e-3 and a == pytest.approx(b) and a < 0.5 and n < 3\n",
        encoding="utf-8",
    )
    assert len(find_bare_tolerances(probe, rel="probe.py")) == 6


@pytest.mark.parametrize("path", _files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_bare_tolerance_across_code_paths(path):
    rel = path.relative_to(ROOT).as_posix()
    hits = find_bare_tolerances(path)
    allowed, why = ALLOWED.get(rel, (0, ""))
    assert len(hits) == allowed, (
        f"{rel}: {len(hits)} bare float tolerance(s), {allowed} allowed ({why or 'none'}). A comparison of two "
        "engines/processes/servers/kernels goes through areal_kernel.testing.noise (a floor measured in the same "
        "test); one that is genuinely not across paths goes into ALLOWED with its reason.\n" + "\n".join(hits)
    )
