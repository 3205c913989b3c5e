"""Requests, responses and trajectories exchanged between rollout and training.

These are plain dataclasses so that every process (controller, inference
client, workflow, trainer) can build and read them without importing torch.
Tensors only appear once a batch is handed to a train engine.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import enum
import hashlib
import itertools
import os
import uuid
from dataclasses import dataclass, field
from typing import Any


class _RequestIds:
    """Unique request ids without a system call each: a random per-process
    prefix (drawn again in a forked child) plus a counter. ``uuid4`` per request
    reads ``/dev/urandom`` every time, which a sandboxed kernel makes cost
    about as much as the rest of a request's client work."""

    def __init__(self) -> None:
        self._fresh()
        os.register_at_fork(after_in_child=self._fresh)

    def _fresh(self) -> None:
        self._prefix = uuid.uuid4().hex[:16]
        self._count = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


new_request_id = _RequestIds()


class StopReason(str, enum.Enum):
    """Why a generation ended."""

    STOP = "stop"  # hit an EOS / stop token
    LENGTH = "length"  # hit max_new_tokens or the context limit
    ABORT = "abort"  # interrupted (e.g. paused for a weight update)
    TOOL_CALL = "tool_call"  # the model asked for a tool; the workflow continues


@dataclass
class GenerationConfig:
    """Sampling parameters, independent of any inference backend."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    n_samples: int = 1  # group size used by workflows, not sent to servers
    # Per-request sampling seed. Servers that honour it (the embedded one) draw
    # the random number for the token at position p from (seed, p) alone, so
    # the same request on the same weights yields the same tokens, whatever
    # else is batched with it and even across an interruption: that is what
    # lets a resumed run regenerate exactly what the killed run would have.
    seed: int | None = None
    # Stop strings: generation ends right after the token that completes one
    # of them (that token is kept, so the output ids stay exactly what was
    # sampled; nothing is trimmed or re-tokenised). The response names the
    # string in ``matched_stop``. A tool-call parser's ``stop_strings`` go
    # here so that a turn ends as soon as a call is complete.
    stop: list[str] = field(default_factory=list)
    # The LoRA adapter to generate with (a name the servers serve beside the
    # base weights); None: the client's default adapter (the one the run
    # trains, if any), else the base model.
    adapter: str | None = None

    def for_evaluation(self, max_new_tokens: int) -> "GenerationConfig":
        """Greedy decoding of up to ``max_new_tokens`` with this config's stop
        tokens and adapter: what a workflow's held-out ``aevaluate`` samples
        with (in a multi-policy run the adapter is the policy's, so each
        policy is evaluated with its own adapter, not the base)."""
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            greedy=True,
            temperature=1.0,
            stop_token_ids=list(self.stop_token_ids),
            adapter=self.adapter,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "greedy": self.greedy,
            "stop_token_ids": list(self.stop_token_ids),
            "seed": self.seed,
            "stop": list(self.stop),
            "adapter": self.adapter,
        }


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """The images of one prompt, in prompt order, as encoded image files
    (PNG, JPEG, ... bytes, exactly as read from the record).

    One object per prompt: every request, response and trajectory of the
    prompt's samples holds a *reference* to the same object, so image data
    exist once per prompt, never once per sample (pickling a batch keeps
    that: pickle stores a shared object once). Servers and train engines
    decode the files with the model's own image processor; ``digest``
    identifies the content (prompt sharing on servers, per-batch caches in
    engines) without comparing bytes.
    """

    files: tuple[bytes, ...]
    digest: str = ""

    def __post_init__(self) -> None:
        files = tuple(self.files)
        if not files or not all(isinstance(f, (bytes, bytearray)) and len(f) > 0 for f in files):
            raise ValueError("ImageInputs.files must be a non-empty sequence of non-empty bytes objects")
        object.__setattr__(self, "files", tuple(bytes(f) for f in files))
        if not self.digest:
            h = hashlib.sha256()
            for f in self.files:
                h.update(len(f).to_bytes(8, "little"))
                h.update(f)
            object.__setattr__(self, "digest", h.hexdigest())

    def __len__(self) -> int:
        return len(self.files)

    def b64(self) -> list[str]:
        """The files base64-encoded (the JSON form servers receive), computed once."""
        cached = self.__dict__.get("_b64")
        if cached is None:
            cached = [base64.b64encode(f).decode("ascii") for f in self.files]
            object.__setattr__(self, "_b64", cached)
        return list(cached)

    @classmethod
    def from_b64(cls, items: list[str]) -> "ImageInputs":
        """Inverse of ``b64`` (what a server does with a request body's ``images``)."""
        return cls(tuple(base64.b64decode(s, validate=True) for s in items))


@dataclass
class ModelRequest:
    """One generation request expressed in token ids.

    ``images``: the prompt's images for a vision-language model; ``input_ids``
    already hold the image placeholder tokens the model's processor expands
    them to. The remote client sends them in the backend's own format
    (``ServerProtocol.add_images``) with every call of the request, including
    the calls that resume it after an interruption."""

    input_ids: list[int]
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    rid: str = field(default_factory=new_request_id)
    metadata: dict[str, Any] = field(default_factory=dict)
    images: ImageInputs | None = None


@dataclass
class ModelResponse:
    """The result of a (possibly resumed) generation.

    ``output_versions[i]`` is the weight version that produced
    ``output_ids[i]``: after an interrupted generation resumes on new
    weights, one response holds tokens of several versions.
    """

    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: StopReason = StopReason.STOP
    latency_s: float = 0.0
    n_interruptions: int = 0
    server: str | None = None
    # The entry of ``GenerationConfig.stop`` that ended the generation
    # (``stop_reason`` is then ``STOP``); None for a stop token, length or abort.
    matched_stop: str | None = None
    # The request's images (the same object, not a copy).
    images: ImageInputs | None = None

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def min_version(self) -> int:
        return min(self.output_versions) if self.output_versions else -1

    @property
    def max_version(self) -> int:
        return max(self.output_versions) if self.output_versions else -1


#: ``Trajectory.metadata`` key of the address of the server that generated
#: the sample (several turns on several servers: their addresses joined by
#: ","); ``samples.jsonl`` records it per trained sample.
SERVER_KEY = "server"


#: ``Trajectory.metadata`` key of the LoRA adapter (in a multi-policy run:
#: the policy) whose weights produced the trajectory's generated tokens (the
#: ``loss_mask`` 1 ones); ``samples.jsonl`` records it per trained sample. A
#: workflow that samples with several adapters in one episode names each
#: trajectory's, and the multi-policy trainer routes the trajectory to that
#: policy's batch (docs/multi-policy.md, Several roles in one episode).
ADAPTER_KEY = "adapter"


def _with_server(metadata: dict[str, Any] | None, server: str | None) -> dict[str, Any]:
    out = dict(metadata or {})
    if server and SERVER_KEY not in out:
        out[SERVER_KEY] = server
    return out


@dataclass
class Trajectory:
    """One sequence ready for training: prompt + completion in one row.

    ``loss_mask[i]`` is 1 for tokens the policy produced (trained on) and 0 for
    prompt / tool / environment tokens. ``logprobs`` and ``versions`` are
    aligned with ``input_ids`` (0.0 / -1 where loss_mask is 0).
    """

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    group_id: str = ""
    sample_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    # The prompt's images (shared by reference with the other samples of the
    # prompt); train engines run the model's vision tower on them.
    images: ImageInputs | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory.{name} has length {len(getattr(self, name))}, expected {n} (len(input_ids))"
                )

    @classmethod
    def from_response(
        cls,
        resp: ModelResponse,
        reward: float,
        group_id: str = "",
        sample_id: str = "",
        metadata: dict[str, Any] | None = None,
    ) -> "Trajectory":
        n_in = len(resp.input_ids)
        return cls(
            input_ids=list(resp.input_ids) + list(resp.output_ids),
            loss_mask=[0] * n_in + [1] * resp.output_len,
            logprobs=[0.0] * n_in + list(resp.output_logprobs),
            versions=[-1] * n_in + list(resp.output_versions),
            reward=float(reward),
            group_id=group_id,
            sample_id=sample_id,
            metadata=_with_server(metadata, resp.server),
            images=resp.images,
        )

    def to_state(self, images: dict[str, list[str]]) -> dict[str, Any]:
        """JSON-ready fields; the images go into ``images`` (digest -> base64
        files, shared by every trajectory of a checkpoint) and the
        trajectory keeps their digest."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "images"}
        out = copy.deepcopy(out)
        if self.images is not None:
            images.setdefault(self.images.digest, self.images.b64())
            out["images"] = self.images.digest
        return out

    @classmethod
    def from_state(
        cls, state: dict[str, Any], images: dict[str, list[str]], cache: dict[str, "ImageInputs"]
    ) -> "Trajectory":
        """Inverse of ``to_state``; ``cache`` makes trajectories of one prompt share one ``ImageInputs`` again."""
        fields = dict(state)
        digest = fields.pop("images", None)
        if digest is not None:
            if digest not in cache:
                cache[digest] = ImageInputs.from_b64(images[digest])
            fields["images"] = cache[digest]
        return cls(**fields)

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def n_generated(self) -> int:
        return int(sum(self.loss_mask))

    def staleness(self, current_version: int) -> int:
        """How many versions behind ``current_version`` its oldest token is."""
        gen = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return current_version - min(gen) if gen else 0


@dataclass
class TrajectoryGroup:
    """Samples of one prompt (a GRPO group). Kept together through filtering."""

    trajectories: list[Trajectory]
    group_id: str = ""
    # The data stream's id of the record this group came from (epoch and
    # index, stable across restarts; set by the rollout executor): what
    # recovery uses to prove no sample is trained twice or skipped.
    sample_uid: str = ""

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


@dataclass
class TrajectoryBatch:
    """A training batch: a list of trajectories plus accounting."""

    trajectories: list[Trajectory]

    def __len__(self) -> int:
        return len(self.trajectories)

    @classmethod
    def from_groups(cls, groups: list[TrajectoryGroup]) -> "TrajectoryBatch":
        return cls(list(itertools.chain.from_iterable(g.trajectories for g in groups)))

    @property
    def n_tokens(self) -> int:
        return sum(t.n_tokens for t in self.trajectories)

    @property
    def n_generated(self) -> int:
        return sum(t.n_generated for t in self.trajectories)


@dataclass
class FinetuneSpec:
    """Step accounting: how many epochs, steps per epoch and total steps."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int  # prompts (groups) per step
    max_steps: int | None = None

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.dataset_size // self.train_batch_size)

    @property
    def total_train_steps(self) -> int:
        total = self.total_train_epochs * self.steps_per_epoch
        return min(total, self.max_steps) if self.max_steps else total
