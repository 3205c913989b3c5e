"""Sessions of the agent proxy: every answer the model gave, token-exact,
its rewards, and the export of a session as training rows.

One session is one episode of one agent. It records each *completion* (one
choice of one ``/v1/chat/completions`` request): the prompt ids, the output
ids, their logprobs and the weight version of each token, exactly as the
inference engine returned them. A completion whose prompt continues an
earlier completion (see ``chat``) has that completion as its ``parent``;
following parents gives the conversation as one token sequence.

Export:

- ``turns``: one ``Trajectory`` per completion (prompt masked, output on the
  loss mask);
- ``trajectory``: one ``Trajectory`` per conversation, i.e. per completion
  that no later completion continued (with ``n=1`` and an agent that keeps
  one history: one row). Every model output along the conversation is on
  the loss mask with its logprobs and versions; template, user and tool
  tokens are masked.

Rewards: ``set_reward`` on the session, or on one turn (a request, all its
choices) or one completion. A conversation row's reward is the session's
reward when set, else the sum of its completions' turn rewards, else unset.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from areal_kernel.api.io import SERVER_KEY, GenerationConfig, StopReason, Trajectory

ExportFormat = Literal["trajectory", "turns"]


class SessionError(Exception):
    """A request the proxy refuses: ``status`` is the HTTP status, ``code`` a
    stable machine-readable name, ``param`` the offending field (if one)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


@dataclass
class Completion:
    """One choice of one chat request, as the inference engine produced it."""

    id: str  # "<response id>/<choice index>"
    response_id: str
    turn: int  # the request's number within its session (0-based)
    index: int  # the choice index within the request
    messages: list[dict[str, Any]]  # the request's messages, as sent
    tools: list[dict] | None
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: StopReason
    reply: dict[str, Any]  # the assistant message the client received
    finish_reason: str
    parent: "Completion | None" = None
    reward: float | None = None
    server: str | None = None  # the address of the server that generated it (provenance)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class Session:
    id: str
    api_key: str
    engine: Any = None  # the inference engine this session's requests go to
    seed: int | None = None  # base seed of its samples (from the record's _sample_seed)
    gconfig: GenerationConfig | None = None  # overrides the proxy's generation settings (evaluation)
    group: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    completions: list[Completion] = field(default_factory=list)
    reward: float | None = None
    n_requests: int = 0
    ended: bool = False
    created: float = field(default_factory=time.time)
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def completion(self, completion_id: str) -> Completion:
        for c in self.completions:
            if c.id == completion_id or c.response_id == completion_id:
                return c
        raise SessionError(
            404, f"session {self.id} has no completion {completion_id!r}", "unknown_completion", "completion_id"
        )

    # -- export -------------------------------------------------------------------
    def leaves(self) -> list[Completion]:
        continued = {id(c.parent) for c in self.completions if c.parent is not None}
        return [c for c in self.completions if id(c) not in continued]

    def chain(self, leaf: Completion) -> list[Completion]:
        out = []
        c: Completion | None = leaf
        while c is not None:
            out.append(c)
            c = c.parent
        return out[::-1]

    def chain_reward(self, chain: list[Completion]) -> float | None:
        if self.reward is not None:
            return self.reward
        turn = [c.reward for c in chain if c.reward is not None]
        return float(sum(turn)) if turn else None

    def export(self, fmt: ExportFormat = "trajectory") -> list[tuple[Trajectory, float | None]]:
        """The session as training rows, each with its reward (``None``: no
        reward was set through the reward API; the row carries 0.0)."""
        rows: list[tuple[Trajectory, float | None]] = []
        if fmt == "turns":
            for c in self.completions:
                reward = c.reward if c.reward is not None else self.reward
                rows.append((self._row([c], reward, f"{self.id}/{c.id}"), reward))
            return rows
        for leaf in self.leaves():
            chain = self.chain(leaf)
            reward = self.chain_reward(chain)
            rows.append((self._row(chain, reward, f"{self.id}/{leaf.id}"), reward))
        return rows

    def _row(self, chain: list[Completion], reward: float | None, sample_id: str) -> Trajectory:
        leaf = chain[-1]
        ids = leaf.tokens
        mask = [0] * len(ids)
        lps = [0.0] * len(ids)
        vers = [-1] * len(ids)
        for c in chain:
            start = len(c.prompt_ids)
            end = start + len(c.output_ids)
            if ids[:end] != c.tokens:  # an invariant of how parents are chosen
                raise AssertionError(f"completion {leaf.id} does not extend {c.id} token for token")
            mask[start:end] = [1] * len(c.output_ids)
            lps[start:end] = c.output_logprobs
            vers[start:end] = c.output_versions
        return Trajectory(
            input_ids=ids,
            loss_mask=mask,
            logprobs=lps,
            versions=vers,
            reward=0.0 if reward is None else float(reward),
            group_id=self.group,
            sample_id=sample_id,
            metadata=self._metadata(chain),
        )

    def _metadata(self, chain: list[Completion]) -> dict[str, Any]:
        meta: dict[str, Any] = {"session_id": self.id, "completions": [c.id for c in chain], **self.metadata}
        # Provenance: the servers that generated the row's turns, in order
        # (samples.jsonl records it; `areal inspect` prints it).
        servers = list(dict.fromkeys(c.server for c in chain if c.server))
        if servers:
            meta[SERVER_KEY] = ",".join(servers)
        return meta

    def summary(self) -> dict[str, Any]:
        return {
            "session_id": self.id,
            "ended": self.ended,
            "requests": self.n_requests,
            "completions": [
                {"id": c.id, "turn": c.turn, "index": c.index, "reward": c.reward, "finish_reason": c.finish_reason}
                for c in self.completions
            ],
            "reward": self.reward,
        }


def export_json(rows: list[tuple[Trajectory, float | None]]) -> list[dict[str, Any]]:
    return [
        {
            "input_ids": t.input_ids,
            "loss_mask": t.loss_mask,
            "logprobs": t.logprobs,
            "versions": t.versions,
            "reward": reward,
            "sample_id": t.sample_id,
            "completions": t.metadata.get("completions", []),
            "server": t.metadata.get(SERVER_KEY),
        }
        for t, reward in rows
    ]


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class SessionStore:
    """All sessions of one proxy. Thread-safe: the proxy's event loop and
    the workflow's (another thread) both use it."""

    KEEP_CLOSED = 10_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._closed: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._by_key: dict[str, Session] = {}

    def open(self, **fields: Any) -> Session:
        s = Session(id=f"sess-{uuid.uuid4().hex[:16]}", api_key=f"sk-areal-{secrets.token_urlsafe(24)}", **fields)
        with self._lock:
            self._sessions[s.id] = s
            self._by_key[_digest(s.api_key)] = s
        return s

    def get(self, session_id: str) -> Session:
        with self._lock:
            s = self._sessions.get(session_id) or self._closed.get(session_id)
        if s is None:
            raise SessionError(404, f"unknown session {session_id!r}", "unknown_session", "session_id")
        return s

    def by_key(self, api_key: str) -> Session | None:
        # Looked up by the key's digest: no comparison of secret bytes.
        with self._lock:
            return self._by_key.get(_digest(api_key))

    def authorised(self, session_id: str, api_key: str | None) -> Session:
        """The session, if ``api_key`` is its key (sessions never see each other)."""
        s = self.get(session_id)
        if not api_key or not secrets.compare_digest(s.api_key, api_key):
            raise SessionError(
                403, f"this API key does not belong to session {session_id}", "wrong_session_key", "Authorization"
            )
        return s

    def set_reward(self, session: Session, reward: Any, turn: Any = None, completion_id: Any = None) -> dict[str, Any]:
        if session.ended:
            raise SessionError(
                409, f"session {session.id} has ended; rewards must be set before it ends", "session_ended"
            )
        if (
            isinstance(reward, bool)
            or not isinstance(reward, (int, float))
            or reward != reward
            or abs(reward) == float("inf")
        ):
            raise SessionError(
                400, f"field 'reward' must be a finite number, got {reward!r}", "invalid_reward", "reward"
            )
        value = float(reward)
        with self._lock:
            if completion_id is not None:
                if not isinstance(completion_id, str):
                    raise SessionError(
                        400, "field 'completion_id' must be a string", "invalid_completion", "completion_id"
                    )
                targets = [session.completion(completion_id)]
                if "/" not in completion_id:  # a response id: every choice of that request
                    targets = [c for c in session.completions if c.response_id == completion_id]
            elif turn is not None:
                if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < session.n_requests:
                    raise SessionError(
                        400,
                        f"field 'turn' must be a request number 0..{session.n_requests - 1} of session {session.id}, "
                        f"got {turn!r}",
                        "invalid_turn",
                        "turn",
                    )
                targets = [c for c in session.completions if c.turn == turn]
            else:
                session.reward = value
                return {"session_id": session.id, "reward": value}
            for c in targets:
                c.reward = value
        return {"session_id": session.id, "reward": value, "completions": [c.id for c in targets]}

    def end(self, session: Session) -> dict[str, Any]:
        with self._lock:
            if session.ended:
                raise SessionError(409, f"session {session.id} has already ended", "session_ended")
            session.ended = True
        try:
            session.done.set_result(session.id)
        except concurrent.futures.InvalidStateError:  # its waiter gave up (cancelled): nobody to tell
            pass
        return session.summary()

    def close(self, session: Session) -> None:
        """Drop a session's recorded tokens (its rows were exported). Its id
        and key stay known for a while (the newest ``KEEP_CLOSED``), so that
        a late reward or request gets "this session has ended", not "unknown"."""
        with self._lock:
            if self._sessions.pop(session.id, None) is None:
                return
            session.ended = True
            session.completions = []
            session.engine = None
            self._closed[session.id] = session
            while len(self._closed) > self.KEEP_CLOSED:
                _, old = self._closed.popitem(last=False)
                self._by_key.pop(_digest(old.api_key), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
