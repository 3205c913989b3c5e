"""``workflow.type: agent``: an agent written against an OpenAI endpoint is
the workflow.

An agent is any class with ``async run(record, *, base_url, api_key) ->
float | None``. For each dataset record the workflow opens
``rollout.gconfig.n_samples`` proxy sessions (one group) and runs the agent
once per session, with the proxy's ``base_url`` and the session's key:

- ``mode: inline``: ``workflow.agent.agent`` names the class
  (``pkg.module:Class`` or ``path/to/file.py:Class``); its ``run`` is a
  coroutine on the rollout event loop.
- ``mode: subprocess``: ``workflow.agent.command`` runs once per session
  with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` set (an unmodified script
  using the ``openai`` client talks to the proxy), the record as JSON on
  stdin and in ``AREAL_AGENT_RECORD``, and ``AREAL_SESSION_ID`` /
  ``AREAL_PROXY_URL`` for the reward API. ``{python}`` in the command is
  this Python interpreter.
- ``mode: online``: no dataset (``dataset.type: agent_sessions``). Each
  admitted slot offers ``n_samples`` sessions; external clients open them
  with ``POST /sessions``, converse, post a reward and end them; a group is
  trained on once all its sessions ended (``areal agent serve``).

The reward of a session, first that applies:

1. a reward posted to the session's reward API (session, turn or
   completion rewards; see ``sessions``);
2. the number the agent returned (inline) or the last line of the
   command's stdout, if it parses as a number (subprocess);
3. the run's reward (``reward.type``) on the decoded model tokens of the
   row, against the record's ``answer`` (inline and subprocess only; an
   online session without a reward is not trained on).

A session whose agent raises, exits non-zero or runs past ``timeout_s`` is
dropped (logged); an episode where every session failed is a failed
rollout (the trainer stops after too many).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import signal
import sys
import weakref
from typing import Any

from areal_kernel.agent.config import AgentSessionsConfig, AgentWorkflowConfig
from areal_kernel.agent.proxy import AgentProxy
from areal_kernel.agent.sessions import Session
from areal_kernel.api.workflow import Workflow
from areal_kernel.api.io import GenerationConfig, Trajectory, TrajectoryGroup
from areal_kernel.errors import ArealError, ConfigError, DataError
from areal_kernel.logging import get_logger
from areal_kernel.utils import aio
from areal_kernel.workflow.scoring import RewardScoring

log = get_logger(__name__)


def load_agent_class(target: str) -> Any:
    """``pkg.module:Class`` or ``path/to/file.py:Class``."""
    mod_name, sep, attr = target.rpartition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(f"workflow.agent.agent: expected 'pkg.module:Class' or 'file.py:Class', got {target!r}")
    try:
        if mod_name.endswith(".py"):
            path = os.path.abspath(mod_name)
            if not os.path.isfile(path):
                raise ConfigError(f"workflow.agent.agent: no file {path}")
            spec = importlib.util.spec_from_file_location(f"areal_agent_{abs(hash(path))}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"workflow.agent.agent: cannot import {mod_name!r}: {e}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(f"workflow.agent.agent: {mod_name!r} has no attribute {attr!r}")
    if not asyncio.iscoroutinefunction(getattr(cls, "run", None)):
        raise ConfigError(f"workflow.agent.agent: {target} has no `async def run(record, *, base_url, api_key)`")
    return cls


class AgentFailed(Exception):
    """One session's agent failed (raised, exited non-zero, timed out)."""


class AgentWorkflow(RewardScoring, Workflow):
    # The agent decides what it reads; the run's reward reads ``answer`` (checked when it is needed).
    required_fields: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        tokenizer: Any,
        gconfig: GenerationConfig,
        reward_target: str,
        reward_pool: Any,
        config: AgentWorkflowConfig | None = None,
    ) -> None:
        if config is None:
            raise ConfigError("workflow.agent: settings are required (mode, and agent or command)")
        self.config = config
        self.gconfig = gconfig
        self.reward_target = reward_target
        self.pool = reward_pool
        self.proxy = AgentProxy(tokenizer, config.proxy, gconfig, require_slots=config.mode == "online")
        # The trainer calls close(); a workflow built and dropped elsewhere stops its proxy when collected.
        self._stop_proxy = weakref.finalize(self, self.proxy.stop)
        self.agent: Any = None
        if config.mode == "inline":
            assert config.agent is not None  # the config model checks it
            self.agent = load_agent_class(config.agent)(**config.agent_kwargs)
        self.agent_failures = 0
        if config.mode == "online":
            url = self.proxy.start()
            print(f"agent proxy: {url} (open sessions with POST {url}/sessions; OpenAI base_url {url}/v1)", flush=True)

    def close(self) -> None:
        self._stop_proxy()

    # -- the kernel's workflow contract ------------------------------------------------
    async def arun_episode(self, engine: Any, record: dict[str, Any]) -> TrajectoryGroup | None:
        self.proxy.start()
        gid = str(record.get("id"))
        n = max(1, self.gconfig.n_samples)
        base = record.get("_sample_seed")
        seeds = [None if base is None else int(base) + i for i in range(n)]
        if self.config.mode == "online":
            return await self._online_group(engine, gid, seeds)
        sessions = [self.proxy.open_session(engine=engine, seed=s, group=gid) for s in seeds]
        try:
            results = await asyncio.gather(*(self._drive(s, record) for s in sessions), return_exceptions=True)
            trajs: list[Trajectory] = []
            errors = []
            for s, res in zip(sessions, results):
                if isinstance(res, BaseException):
                    if not isinstance(res, AgentFailed):
                        raise res
                    errors.append(str(res))
                    continue
                trajs.extend(await self._rows(s, record, res))
            if errors:
                self.agent_failures += len(errors)
                log.warning("agent sessions failed; dropped", record=gid, failed=len(errors), error=errors[-1])
                if len(errors) == len(sessions):
                    raise ArealError(f"every agent session of record {gid!r} failed; last: {errors[-1]}")
            return TrajectoryGroup(trajs, group_id=gid) if trajs else None
        finally:
            for s in sessions:
                self.proxy.forget(s)

    async def aevaluate(self, engine: Any, record: dict[str, Any], max_new_tokens: int) -> tuple[float, str]:
        """One greedy run of the agent on ``record``: (reward, the model's text)."""
        if self.config.mode == "online":
            raise ArealError("workflow.agent: mode 'online' has no held-out records to evaluate (trainer.eval_size: 0)")
        self.proxy.start()
        g = self.proxy.gconfig.for_evaluation(max_new_tokens)
        session = self.proxy.open_session(engine=engine, gconfig=g, group=str(record.get("id")))
        try:
            agent_reward = await self._drive(session, record)
            rows = await self._rows(session, record, agent_reward)
        finally:
            self.proxy.forget(session)
        if not rows:
            return 0.0, ""
        return rows[0].reward, str(rows[0].metadata.get("completion", ""))

    def encode_prompt(self, record: dict[str, Any]) -> list[int]:
        """For ``areal check``'s display: the record's ``prompt`` as one user
        message (the agent may build another conversation)."""
        prompt = record.get("prompt")
        return self.proxy.chat.prompt([{"role": "user", "content": str(prompt)}], None) if prompt else []

    # -- sessions --------------------------------------------------------------------
    async def _drive(self, session: Session, record: dict[str, Any]) -> float | None:
        """Run the agent for one session; ends the session; returns its own reward."""
        try:
            if self.config.mode == "inline":
                coro = self.agent.run(dict(record), base_url=self.proxy.base_url, api_key=session.api_key)
                try:
                    # Tasks the agent leaves running end with its session (utils.aio).
                    async with aio.scope(f"agent session {session.id}"):
                        out = await asyncio.wait_for(coro, self.config.timeout_s)
                except asyncio.TimeoutError:
                    raise AgentFailed(f"agent timed out after {self.config.timeout_s:g} s") from None
                except Exception as e:
                    raise AgentFailed(f"agent raised {type(e).__name__}: {e}") from e
                return _as_reward(out, "the agent's run() returned")
            return await self._subprocess(session, record)
        finally:
            self.proxy.end_session(session)

    async def _subprocess(self, session: Session, record: dict[str, Any]) -> float | None:
        assert self.config.command is not None
        argv = [sys.executable if a == "{python}" else a for a in self.config.command]
        payload = json.dumps(record, default=str)
        env = dict(os.environ)
        env.update({
            "OPENAI_BASE_URL": self.proxy.base_url,
            "OPENAI_API_KEY": session.api_key,
            "AREAL_SESSION_ID": session.id,
            "AREAL_PROXY_URL": self.proxy.url,
            "AREAL_AGENT_RECORD": payload,
        })  # fmt: skip
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            raise AgentFailed(f"workflow.agent.command {argv[0]!r} cannot start: {e}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(payload.encode()), self.config.timeout_s)
        except asyncio.TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            raise AgentFailed(f"agent command timed out after {self.config.timeout_s:g} s") from None
        except asyncio.CancelledError:
            _kill_group(proc.pid)
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-5:]
            raise AgentFailed(f"agent command exited with {proc.returncode}: " + " | ".join(tail))
        lines = [ln.strip() for ln in out.decode(errors="replace").splitlines() if ln.strip()]
        if not lines:
            return None
        try:
            return _as_reward(float(lines[-1]), "the agent command's last stdout line")
        except ValueError:
            return None

    async def _online_group(self, engine: Any, gid: str, seeds: list[int | None]) -> TrajectoryGroup | None:
        slots = self.proxy.offer_slots(engine, gid, seeds)
        sessions: list[Session] = []
        try:
            for slot in slots:
                sessions.append(await asyncio.wrap_future(slot.claimed))
            waits = [asyncio.wrap_future(s.done) for s in sessions]
            await asyncio.wait(waits, timeout=self.config.timeout_s)
            for s in sessions:
                if not s.ended:
                    log.warning("online session did not end in time; ended now", session=s.id)
                    self.proxy.end_session(s)
            trajs: list[Trajectory] = []
            for s in sessions:
                rows = [(t, r) for t, r in s.export(self.config.export) if r is not None]
                if s.completions and not rows:
                    log.warning("online session ended without a reward; not trained on", session=s.id)
                trajs.extend(_with_reward(t, float(r)) for t, r in rows)
            return TrajectoryGroup(trajs, group_id=gid) if trajs else None
        finally:
            for slot in slots:
                slot.cancelled = True
            for s in sessions:
                self.proxy.forget(s)

    async def _rows(self, session: Session, record: dict[str, Any], agent_reward: float | None) -> list[Trajectory]:
        out = []
        for traj, api_reward in session.export(self.config.export):
            text = self.proxy.chat.decode([t for t, m in zip(traj.input_ids, traj.loss_mask) if m])
            if api_reward is not None:
                reward = api_reward
            elif agent_reward is not None:
                reward = agent_reward
            else:
                reward = await self._score(text, record)
            traj = _with_reward(traj, reward)
            traj.metadata["completion"] = text
            out.append(traj)
        return out

    async def _score(self, completion: str, record: dict[str, Any]) -> float:
        if "answer" not in record:
            raise DataError(
                f"record {record.get('id')!r} has no 'answer': the agent returned no reward and set none through "
                "the reward API, so the run's reward would score the answer against it"
            )
        return await self.score(completion, record["answer"])


def _with_reward(traj: Trajectory, reward: float) -> Trajectory:
    traj.reward = float(reward)
    return traj


def _as_reward(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise AgentFailed(f"{what} {value!r}; expected a finite number or None")
    return float(value)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def agent_sessions_source(config: Any, seed: int, required: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    """``dataset.type: agent_sessions``: one record per slot of an online
    run (the sessions are the data); no held-out records."""
    settings = config.plugin_config or AgentSessionsConfig()
    return [{"id": f"slot-{i}"} for i in range(settings.slots)], []
