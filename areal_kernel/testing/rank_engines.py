"""Shared suites for train engines whose model lives in rank processes
(``areal_kernel.engine.ranked.RankedTrainEngine`` subclasses: areal-fsdp,
areal-megatron): the tests every such engine owes beyond
``TrainEngineContract``, written once.

- :class:`RankEngineGRPOSuite`: a real asynchronous GRPO run through
  ``areal train`` on a tiny byte-level model that must clear a learning bar
  (``areal_kernel.testing.learning.TINY_CHARS``), and its ``lr=0`` control
  that must not.
- :class:`RankEngineRecoverySuite`: ``kill -9`` of a real ``areal train``
  after a recovery checkpoint, ``recover: auto``, and the same samples and
  weights as an uninterrupted run.
- :class:`RankEngineWeightUpdateSuite` (the in-memory broadcast) and
  :class:`RankEngineDiskUpdateSuite` (the disk transport with the streamed
  export): weights from the ranks into a real embedded inference server,
  through the kernel's transport hook and registry, as ``areal train`` does.

A plugin subclasses each suite in a test file of its own and sets the class
attributes the suite names (its engine name, its example config, ...); the
weight-update suites also ask for a fixture giving the engine under test.
The helpers below (``random_batch``, ``ppo_step_inputs``, ``forward_floor``,
``make_spread_tiny_llama``, ``torch_references``) are what these suites and
an engine's parity tests build batches, floors, models and reference engines
from; ``state_round_trip`` is the parity tests' check that a checkpoint of
the engine continues training identically, and ``plugin_example`` names a
plugin's example config for a suite's ``EXAMPLE``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from areal_kernel.testing.learning import (
    TINY_CHARS,
    TINY_LR,
    TINY_OVERRIDES,
    TINY_STEPS,
    LearningCheck,
    frozen_overrides,
    step_rows,
)
from areal_kernel.testing.noise import NoiseFloor, assert_within_noise, max_difference
from areal_kernel.testing.recovery import EXACT_SERVER, assert_bit_equal

if TYPE_CHECKING:
    from areal_kernel.api.io import ModelResponse, TrajectoryBatch

__all__ = [
    "RankEngineGRPOSuite",
    "RankEngineRecoverySuite",
    "RankEngineWeightUpdateSuite",
    "RankEngineDiskUpdateSuite",
    "random_batch",
    "ppo_step_inputs",
    "forward_floor",
    "make_spread_tiny_llama",
    "state_round_trip",
    "torch_references",
    "plugin_example",
    "StateRoundTrip",
]


# ---------------------------------------------------------------- helpers


def random_batch(
    lengths: list[int], seed: int = 0, prompt_len: int = 3, vocab: int = 256, shared_prompts: bool = False
) -> TrajectoryBatch:
    """Trajectories of random tokens; consecutive pairs form a GRPO group
    (with ``shared_prompts`` the pair also shares its first ``prompt_len`` tokens)."""
    import random

    from areal_kernel.api.io import Trajectory, TrajectoryBatch

    rng = random.Random(seed)
    trajs: list[Trajectory] = []
    for k, n in enumerate(lengths):
        p = min(prompt_len, n - 1)
        ids = [rng.randrange(4, vocab) for _ in range(n)]
        if shared_prompts and k % 2 == 1 and len(trajs[-1].input_ids) > p:
            ids[:p] = trajs[-1].input_ids[:p]
        trajs.append(
            Trajectory(
                input_ids=ids,
                loss_mask=[0] * p + [1] * (n - p),
                logprobs=[0.0] * p + [-rng.uniform(3.0, 8.0) for _ in range(n - p)],
                versions=[-1] * p + [0] * (n - p),
                reward=float(k % 2),
                group_id=f"g{k // 2}",
            )
        )
    return TrajectoryBatch(trajs)


def ppo_step_inputs(batch: TrajectoryBatch, engine: Any) -> dict[str, Any]:
    """GRPO-style extras: +1/-1 advantages by reward, proximal logprobs from ``engine``."""
    adv = [[(1.0 if t.reward > 0 else -1.0) * m for m in t.loss_mask] for t in batch.trajectories]
    return {"advantages": adv, "prox_logprobs": engine.compute_logprobs(batch, only_loss_tokens=True)}


def torch_references(
    cfg: dict[str, Any], noise_cfg: dict[str, Any], model_dir: str, total_steps: int
) -> tuple[Any, Any]:
    """A parity test's two single-process engines, initialized on
    ``model_dir``: the kernel's torch engine with ``cfg`` (the reference a
    rank engine must match) and with ``noise_cfg`` (another micro-batch
    split: the same numbers summed in another order, the noise floor)."""
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    engines = (TorchTrainEngine(cfg), TorchTrainEngine(noise_cfg))
    for e in engines:
        e.initialize(model_dir, total_steps)
    return engines


def train_beside_references(
    engine: Any,
    cfg: dict[str, Any],
    noise_cfg: dict[str, Any],
    model_dir: str,
    batches: list[TrajectoryBatch],
    loss: Any,
    stat_keys: tuple[str, ...],
    total_steps: int = 10,
) -> tuple[Any, list[tuple[dict[str, Any], dict[str, Any]]], dict[str, NoiseFloor]]:
    """A parity test's run: ``engine`` and the two ``torch_references`` take
    one step on each of ``batches`` (each computing its own proximal
    logprobs, which must agree too). Returns the reference engine, the
    ``(engine stats, reference stats)`` of every step, and the floors
    measured between the two references: per stat of ``stat_keys``
    (relative), ``logprobs`` and ``token_entropy`` on a probe batch after the
    last step, and ``weights``."""
    from areal_kernel.testing.noise import measure_noise_floor

    ref, noise = torch_references(cfg, noise_cfg, model_dir, total_steps)
    history, noise_history = [], []
    for batch in batches:
        a = engine.train_batch(batch, loss, ppo_step_inputs(batch, engine))
        b = ref.train_batch(batch, loss, ppo_step_inputs(batch, ref))
        c = noise.train_batch(batch, loss, ppo_step_inputs(batch, noise))
        history.append((a, b))
        noise_history.append(c)
    probe = random_batch([10, 7, 12], seed=99)
    lp_n, ent_n = noise.compute_logprobs_and_entropy(probe)
    lp_r, ent_r = ref.compute_logprobs_and_entropy(probe)
    floor = {
        k: measure_noise_floor(k, [b[k] for _, b in history], [c[k] for c in noise_history], relative=True)
        for k in stat_keys
    }
    floor["logprobs"] = measure_noise_floor("logprobs", lp_r, lp_n)
    floor["token_entropy"] = measure_noise_floor("token_entropy", ent_r, ent_n)
    floor["weights"] = measure_noise_floor(
        "weights", dict(ref.named_weights_for_transfer()), dict(noise.named_weights_for_transfer())
    )
    return ref, history, floor


def forward_floor(model_dir: str, weights: dict[str, Any], ids: list[int], start: int) -> NoiseFloor:
    """The noise floor of a comparison with these weights' logprobs of
    ``ids[start:]``: transformers' forward with sdpa against eager attention
    (``areal_kernel.testing.noise``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal_kernel.testing.noise import measure_noise_floor

    rows = []
    for attn in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()
        model.load_state_dict(weights, strict=False)  # a tied lm_head is not in the transfer names
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        rows.append([logp[i - 1, ids[i]].item() for i in range(start, len(ids))])
    return measure_noise_floor("logprobs, same weights", rows[0], rows[1])


def make_spread_tiny_llama(path: str, layers: int = 2) -> str:
    """A tiny random Llama (``make_tiny_llama``: vocab 256, tied embeddings,
    seed 3) whose matrices are redrawn with std 0.2 (seed 0), so that greedy
    generations depend on the weights: a stale weight update shows."""
    import torch
    from safetensors.torch import load_file, save_file

    from areal_kernel.testing.models import make_tiny_llama

    d = make_tiny_llama(path, seed=3, layers=layers)
    file = os.path.join(d, "model.safetensors")
    sd = load_file(file)
    g = torch.Generator().manual_seed(0)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.2 if v.dim() > 1 else v) for k, v in sd.items()}
    save_file(sd, file, metadata={"format": "pt"})
    return d


@dataclass
class Continuation:
    """What two training steps gave: their stats, then a probe's logprobs and the engine's step count."""

    stats: list[dict[str, float]]
    logprobs: list[list[float]]
    step: int


@dataclass
class StateRoundTrip:
    """``state_round_trip``'s record: the two steps after ``save_state``
    (``first``), the same two after ``load_state`` (``second``), and the
    version and step count that ``load_state`` restored."""

    SAVED_VERSION: ClassVar[int] = 7

    ckpt: str
    first: Continuation
    second: Continuation
    loaded_version: int
    loaded_step: int

    # The same steps from the same state on the same ranks: only the
    # checkpoint's own rounding may differ (none expected; bounds far below
    # what a lost optimizer state or schedule step changes).
    def assert_continues_identically(self) -> None:
        assert self.loaded_version == StateRoundTrip.SAVED_VERSION, self.loaded_version
        assert self.first.step == self.second.step == self.loaded_step + len(self.first.stats)
        for a, b in zip(self.first.stats, self.second.stats):
            for k in ("loss", "grad_norm", "lr", "pg_loss"):
                assert a[k] == pytest.approx(b[k], rel=1e-7, abs=1e-9), k
        assert max_difference(self.first.logprobs, self.second.logprobs).value < 1e-6


def state_round_trip(engine: Any, ckpt: str, loss: Any) -> StateRoundTrip:
    """Save ``engine``'s state (at version 7) into ``ckpt``, train two steps,
    move the version on, load the state back and train the same two steps
    again; ``StateRoundTrip.assert_continues_identically`` then checks that
    the checkpoint restored everything training depends on."""
    engine.set_version(StateRoundTrip.SAVED_VERSION)
    engine.save_state(ckpt)
    probe = random_batch([10, 7, 12], seed=42)

    def two_steps() -> Continuation:
        stats = []
        for seed in (20, 21):
            batch = random_batch([8, 11, 6, 9], seed=seed)
            stats.append(engine.train_batch(batch, loss, ppo_step_inputs(batch, engine)))
        return Continuation(stats, engine.compute_logprobs(probe), engine.step)

    first = two_steps()
    engine.set_version(99)
    engine.load_state(ckpt)
    version, step = engine.get_version(), engine.step
    return StateRoundTrip(ckpt, first, two_steps(), version, step)


def plugin_example(test_file: str, name: str) -> str:
    """The example config ``name`` of the plugin whose ``tests/`` holds
    ``test_file`` (``<plugin>/examples/<name>``): a suite's ``EXAMPLE``."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(test_file))), "examples", name)


def _failed(proc: Any) -> str:
    return str(proc.stdout[-3000:] + proc.stderr[-3000:])


class _RankEngineSuite:
    """What every suite here has: the engine's ``actor.backend`` name and the
    ``slow`` mark (each starts rank processes), inherited by the plugin's class."""

    pytestmark: ClassVar[Any] = pytest.mark.slow
    ENGINE_NAME: ClassVar[str]


# ---------------------------------------------------------------- end to end


class RankEngineGRPOSuite(_RankEngineSuite):
    """A real asynchronous GRPO run through ``areal train`` with the plugin's
    example (``EXAMPLE``: ``N_RANKS`` rank processes, one embedded inference
    server, weights in memory every step) on a tiny random Llama with a
    byte-level tokenizer, scored by the ``char_share`` reward, which a random
    model learns within a dozen steps (``TINY_OVERRIDES``, the engine's lr
    at ``TINY_LR``).

    Asserted, in both arms: staleness stays bounded (some samples one version
    old, none older), versions advance, every step ran on ``N_RANKS`` ranks
    and broadcast the whole model, the ranks logged to
    ``<run_dir>/<ENGINE_NAME>-ranks`` and are gone, and the final HF export is
    a loadable directory. The ``learning`` arm's sampling reward clears
    ``CHECK``'s bar (``TINY_CHARS``: steps 9-12) and the ``frozen`` arm's
    (every lr 0, the negative control) does not.

    The engine is what is tested here, not the model: a SmolLM2 run of this
    suite took 128-190 s a time on two cores and needed the kernel's control
    (the torch engine's) shared with it; tiny runs take about 30 s an arm.

    Class attributes: ``ENGINE_NAME`` (the ``actor.backend`` name),
    ``EXAMPLE`` (path of the plugin's example config), ``N_RANKS``, ``STEPS``,
    ``CHECK``, ``OVERRIDES`` (more of the example's settings, e.g. another layout),
    ``STEP_METRICS`` (metrics every step's row must carry, e.g. a layout's own);
    ``make_model`` (another tiny byte-level model, e.g. a mixture of experts).
    Fixtures: ``run_areal`` (the kernel's pytest plugin), ``tmp_path``."""

    EXAMPLE: ClassVar[str]
    N_RANKS: ClassVar[int] = 2
    STEPS: ClassVar[int] = TINY_STEPS
    CHECK: ClassVar[LearningCheck] = TINY_CHARS
    # More overrides of the example (another layout of the same engine: "actor.backend=fsdp:t2").
    OVERRIDES: ClassVar[tuple[str, ...]] = ()
    # Keys of metrics.jsonl every step row must have (finite numbers).
    STEP_METRICS: ClassVar[tuple[str, ...]] = ()

    def make_model(self, path: str) -> str:
        """The model the run trains, written to ``path`` (with its byte-level chat tokenizer)."""
        from areal_kernel.testing.models import make_tiny_byte_chat_llama

        return make_tiny_byte_chat_llama(path)

    @pytest.mark.parametrize("arm", ["learning", "frozen"])
    def test_grpo_raises_the_reward(self, arm: str, run_areal: Any, tmp_path: Any) -> None:
        """Over 20 s: ``N_RANKS`` ranks plus a server start, and ``STEPS``
        GRPO steps of the tiny model."""
        model = self.make_model(str(tmp_path / "model"))
        lr_key = f"actor.{self.ENGINE_NAME}.lr"
        run_dir = str(tmp_path / "run")
        proc = run_areal(
            "train", self.EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", f"trainer.max_steps={self.STEPS}",
            "trainer.eval_size=0", "logging.sinks=[jsonl]", *TINY_OVERRIDES, f"{lr_key}={TINY_LR}",
            *self.OVERRIDES, *(frozen_overrides(lr_key) if arm == "frozen" else []),
            timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, _failed(proc)
        steps = step_rows(run_dir)
        assert len(steps) == self.STEPS
        assert all(r["train/n_ranks"] == float(self.N_RANKS) and r["train/skipped"] == 0.0 for r in steps)
        for key in self.STEP_METRICS:
            values = [r.get(key) for r in steps]
            assert all(v is not None and math.isfinite(v) for v in values), (key, values)
        # Asynchronous (some samples one version old), never staler than allowed.
        assert max(r["rollout/staleness_max"] for r in steps) <= 1
        assert any(r["rollout/staleness_max"] == 1 for r in steps), [r["rollout/staleness_max"] for r in steps]
        assert [r["version"] for r in steps] == list(range(1, self.STEPS + 1))
        # The whole model broadcast from the ranks each step (the file less its JSON header).
        model_mb = os.path.getsize(os.path.join(model, "model.safetensors")) / 2**20
        assert all(r["weights/mb"] > 0.98 * model_mb for r in steps), ([r["weights/mb"] for r in steps], model_mb)
        # The ranks logged to the run dir and are gone; the export is a loadable HF dir.
        logs = sorted(os.listdir(os.path.join(run_dir, f"{self.ENGINE_NAME}-ranks")))
        assert logs == sorted(f"rank-{r}.log" for r in range(self.N_RANKS))
        with open(os.path.join(run_dir, "result.json")) as f:
            final = json.load(f)["checkpoint"]
        assert os.path.isfile(os.path.join(final, "config.json")) and os.path.isfile(
            os.path.join(final, "tokenizer_config.json")
        )
        assert any(f.endswith(".safetensors") for f in os.listdir(final))
        print(f"\n{arm}: {self.CHECK.describe(steps)}")
        self.CHECK.assert_arm(arm, steps)


# ---------------------------------------------------------------- recovery


class RankEngineRecoverySuite(_RankEngineSuite):
    """Exact recovery: ``kill -9`` a real ``areal train`` with the plugin's
    example after recovery checkpoint 1 (``kill_after_checkpoint``), run it
    again (``recover: auto``) and compare with an uninterrupted run: same
    sample ids per step, same final weights, and training moved them.

    Tiny random Llama with SmolLM2's tokenizer (``make_tiny_chat_llama``);
    its arithmetic rewards are 0, so an entropy bonus is what makes each
    update depend on the sampled tokens.

    Class attributes: ``ENGINE_NAME`` (its ``actor.<name>`` section takes
    ``lr``), ``EXAMPLE``, ``STEPS``, ``EXTRA_ARGS`` (overrides such as
    ``actor.backend=<name>:t2`` for the layout under test). A layout that
    needs another model (experts) overrides the class fixture ``tiny_chat_model``."""

    EXAMPLE: ClassVar[str]
    STEPS: ClassVar[int]
    EXTRA_ARGS: ClassVar[tuple[str, ...]] = ()

    # classmethods: pytest (9.x) deprecates class-scoped fixtures defined as
    # instance methods (each test gets a new instance anyway).
    @pytest.fixture(scope="class")
    @classmethod
    def tiny_chat_model(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        from areal_kernel.testing.models import make_tiny_chat_llama

        return make_tiny_chat_llama(tmp_path_factory.mktemp(f"tiny-{cls.ENGINE_NAME}-recovery"))

    def train_args(self, model: str, run_dir: str) -> list[str]:
        """The ``areal`` arguments of both runs."""
        return [
            "train", self.EXAMPLE, f"model.path={model}", f"run_dir={run_dir}", *self.EXTRA_ARGS,
            f"trainer.max_steps={self.STEPS}", "trainer.batch_size=2", "trainer.eval_size=0",
            "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=6", "rollout.max_staleness=0",
            "algorithm.dynamic_filter=false", "algorithm.entropy_coef=0.05", f"actor.{self.ENGINE_NAME}.lr=1e-3",
            "checkpoint.save_every=1", "logging.sinks=[jsonl]", *EXACT_SERVER,
        ]  # fmt: skip

    def test_killed_run_resumes_exactly(self, tiny_chat_model: str, tmp_path: Any) -> None:
        """Over 60 s (about 65 s on an idle 2-core machine, 224 s seen for
        FSDP with other work on the cores): three runs of ``areal train``
        (uninterrupted, killed, resumed), each starting its ranks and a server."""
        from areal_kernel.testing.recovery import kill_after_checkpoint, load_weights, read_samples, run_train

        ref_dir, run_dir = str(tmp_path / "reference"), str(tmp_path / "killed")
        ref = run_train(self.train_args(tiny_chat_model, ref_dir))
        assert ref.returncode == 0, _failed(ref)
        kill_after_checkpoint(self.train_args(tiny_chat_model, run_dir), run_dir, step=1)
        resumed = run_train(self.train_args(tiny_chat_model, run_dir))
        assert resumed.returncode == 0, _failed(resumed)
        with open(os.path.join(run_dir, "result.json")) as f:
            assert json.load(f)["resumed_from_step"] == 1
        got, want = read_samples(run_dir), read_samples(ref_dir)
        assert [s["step"] for s in got] == list(range(1, self.STEPS + 1))
        assert [s["uids"] for s in got] == [s["uids"] for s in want]
        a = load_weights(os.path.join(ref_dir, "checkpoints", "final"))
        b = load_weights(os.path.join(run_dir, "checkpoints", "final"))
        base = load_weights(tiny_chat_model)
        assert max(float((a[k] - base[k]).abs().max()) for k in a if k in base) > 1e-4  # training moved them
        assert_bit_equal(b, a)


# ---------------------------------------------------------------- weight updates


class _WeightUpdateBase(_RankEngineSuite):
    """What both weight-update suites share: a real embedded server on
    ``tiny_model_dir`` (a fixture of the plugin's conftest, the model the
    engine under test holds), greedy generation from it, and the comparison
    of its logprobs with the ranks' recompute."""

    PROMPT: ClassVar[list[int]] = [5, 6, 7, 8, 9]
    # The server (KV-cache decoding) against the ranks' recompute: within
    # SERVER_MULTIPLE x the sdpa-vs-eager floor of a forward with the same
    # weights (forward_floor), as in tests/inference. Measured with 2 FSDP
    # ranks 0.3-1.4x (AVX-512) and 1.8-2.3x (ATEN_CPU_CAPABILITY=avx2): 8x
    # leaves 3x headroom; a stale weight is off by > 1e-3 (asserted).
    SERVER_MULTIPLE: ClassVar[float] = 8.0

    @pytest.fixture(scope="class")
    @classmethod
    def server_client(cls, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
        from areal_kernel.testing.servers import embedded_server

        with embedded_server(tiny_model_dir, str(tmp_path_factory.mktemp("srv"))) as client:
            yield client

    def greedy(self, client: Any) -> ModelResponse:
        from areal_kernel.api.io import GenerationConfig, ModelRequest

        async def go() -> ModelResponse:
            try:
                req = ModelRequest(list(self.PROMPT), GenerationConfig(max_new_tokens=8, greedy=True))
                return await client.agenerate(req)  # type: ignore[no-any-return]
            finally:
                await client.aclose(current_loop_only=True)

        return asyncio.run(go())

    @staticmethod
    def delivery(engine: Any, client: Any, version: int) -> dict[str, float]:
        """The weight-delivery check (``monitor.weights``) over every tensor of
        the tiny model: the engine's ranks sample what they hold, the server
        fingerprints what it loaded. Returns the check's metrics."""
        from areal_kernel.monitor.weights import WeightsMonitor

        said: list[str] = []
        monitor = WeightsMonitor(action="warn", tensors_per_update=10_000, warn=said.append)
        metrics = monitor.check(version, engine, client)
        assert monitor.skipped is None and metrics["weights_checked"] > 0, said
        return metrics

    def transport(self, mode: str, engine: Any, client: Any, run_dir: str, bucket_bytes: int) -> tuple[str, Any]:
        """The transport the kernel's hook selects for ``mode`` on cpu, built
        from the registry as ``areal train`` builds it."""
        from areal_kernel.plugins import get_plugin_manager, get_registry

        name = get_plugin_manager().hook.areal_select_weight_transport(
            train_backend=self.ENGINE_NAME, inference_backend="embedded", platform="cpu", mode=mode
        )
        return name, get_registry().get("weight_transport", name).load()(engine, client, run_dir, bucket_bytes)

    @staticmethod
    def engine_logprobs(engine: Any, resp: ModelResponse) -> list[float]:
        from areal_kernel.api.io import Trajectory, TrajectoryBatch

        ids = list(resp.input_ids) + list(resp.output_ids)
        n = len(ids)
        lp = engine.compute_logprobs(TrajectoryBatch([Trajectory(ids, [0] * n, [0.0] * n, [-1] * n, reward=0.0)]))[0]
        return list(lp[len(resp.input_ids) :])

    def disagreement(self, engine: Any, resp: ModelResponse) -> float:
        return max(abs(a - b) for a, b in zip(resp.output_logprobs, self.engine_logprobs(engine, resp)))

    def check_agree(self, engine: Any, resp: ModelResponse) -> None:
        """The server's logprobs against the ranks' recompute, on the floor of
        a forward with the weights the ranks hold (gathered to full HF tensors)."""
        ids = list(resp.input_ids) + list(resp.output_ids)
        floor = forward_floor(engine.model_path, engine.full_weights(), ids, len(resp.input_ids))
        print(
            assert_within_noise(resp.output_logprobs, self.engine_logprobs(engine, resp), floor, self.SERVER_MULTIPLE)
        )

    @staticmethod
    def train_steps(engine: Any, seeds: range, lengths: list[int]) -> None:
        from areal_kernel.algo.losses import make_ppo_loss_fn

        loss = make_ppo_loss_fn(eps_clip=0.2)
        for seed in seeds:
            batch = random_batch(lengths, seed=seed)
            engine.train_batch(batch, loss, ppo_step_inputs(batch, engine))


class RankEngineWeightUpdateSuite(_WeightUpdateBase):
    """The in-memory broadcast from the ranks (asked for by name: the kernel
    default on cpu is disk) in many 16 KB buckets: the server computes what
    the ranks hold; after training the server has not moved by itself; the
    update brings it to the trained weights. The weight-delivery check
    (sampled in the ranks) is clean after each update and finds the stale
    server in between.

    Class attribute ``ENGINE_NAME``. Fixtures: ``update_engine`` (an
    initialized engine of the plugin on ``tiny_model_dir``, lr about 1e-3;
    parametrise it for several layouts), ``tiny_model_dir``
    (``make_spread_tiny_llama`` gives one whose generations show a stale weight)."""

    def test_broadcast_changes_server_outputs(self, update_engine: Any, server_client: Any, tmp_path: Any) -> None:
        engine, client = update_engine, server_client
        name, transport = self.transport("broadcast", engine, client, str(tmp_path), bucket_bytes=16 << 10)
        assert name == "broadcast"
        transport.setup()
        try:
            # (1) Push the engine's current weights: the server then computes what the ranks hold.
            v1 = client.get_version() + 1
            assert transport.update(v1)["weights/mb"] > 0.05
            first = self.greedy(client)
            assert set(first.output_versions) == {v1}
            self.check_agree(engine, first)
            # The weight-delivery check, sampled in the ranks, finds what was sent.
            assert self.delivery(engine, client, v1)["weights_mismatch"] == 0
            # (2) Train: the engine moves away from what the server serves.
            self.train_steps(engine, range(3), [6, 8, 7, 9])
            assert self.disagreement(engine, first) > 1e-3
            # The server did not move by itself.
            assert self.greedy(client).output_logprobs == first.output_logprobs
            # The check's negative control: the server is stale against the ranks.
            assert self.delivery(engine, client, v1 + 1)["weights_mismatch"] > 0
            # (3) The in-memory update brings the server to the trained weights.
            v2 = v1 + 1
            transport.update(v2)
            second = self.greedy(client)
            assert client.get_version() == v2 and set(second.output_versions) == {v2}
            self.check_agree(engine, second)
            assert second.output_logprobs != first.output_logprobs
            assert self.delivery(engine, client, v2)["weights_mismatch"] == 0
        finally:
            transport.close()


class RankEngineDiskUpdateSuite(_WeightUpdateBase):
    """The disk transport (the kernel default on cpu) writes the engine's
    streamed HF export after a training step, and the server serves it.
    Same class attribute and fixtures as :class:`RankEngineWeightUpdateSuite`."""

    def test_disk_transport_uses_the_streamed_export(
        self, update_engine: Any, server_client: Any, tmp_path: Any
    ) -> None:
        engine, client = update_engine, server_client
        self.train_steps(engine, range(11, 12), [7, 9, 6, 8])
        name, transport = self.transport("disk", engine, client, str(tmp_path), bucket_bytes=0)
        assert name == "disk"
        transport.setup()
        try:
            version = client.get_version() + 1
            transport.update(version)
            after = self.greedy(client)
            assert set(after.output_versions) == {version}
            self.check_agree(engine, after)
        finally:
            transport.close()
