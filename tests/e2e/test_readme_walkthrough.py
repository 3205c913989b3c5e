"""A newcomer's first hour: the README's ```bash blocks, run the way a user
would (install excluded), so the README cannot drift from what works.

The commands are read from README.md itself: a change there that breaks a
command fails here. They run as real subprocesses of the installed ``areal``
script and ``python``, from a scratch directory in which ``examples`` and
``plugins`` are links to the checkout (the README's commands are run "from
the repo root", and their run directories must not land in the checkout).
Only the substitutions in ``SUBSTITUTIONS`` are made, each with its reason;
``EXCLUDED`` lists the commands not run and why. A command in a bash block
that is neither run nor excluded fails ``test_every_readme_command_is_covered``.

This file takes several minutes (why over 60 s): it runs every command of
the walkthrough for real: three tiny-model runs (`areal check`, `areal train
my.yaml`, the SFT example), the demo for 2 steps on SmolLM2-135M (its
held-out evaluation before and after included), an `areal inf` gateway with
a SmolLM2 replica, and an `areal agent run` service of two workers on
another. They run one after another, so the memory at any time is that of
one SmolLM2 training run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
BIN = Path(sys.executable).parent  # the environment's `areal` and `python`, as on a user's PATH

# Every change made to a README command before it runs, and why.
SUBSTITUTIONS = {
    "my.yaml": "the README's stand-in for the user's own config: a file my.yaml in the working directory, "
    "examples/grpo_arithmetic.yaml with the tiny random Llama (SmolLM2's tokenizer), 2 steps and small batches, "
    "so `areal check`/`plan`/`train my.yaml` finish in seconds",
    "key.sub=value ...": "a placeholder for overrides: dropped (my.yaml is already small)",
    "[--json]": "optional flag: the command is run without it and with it",
    "make demo": "run as `areal train examples/grpo_arithmetic.yaml trainer.max_steps=2 trainer.eval_size=8` (what "
    "`make demo` runs, shortened from 20 steps and a 32-prompt held-out evaluation: the learning itself is checked "
    "by tests/e2e/test_grpo_learns.py and bench/bench_demo_seeds.py), then the `areal report` line of the Makefile's "
    "demo recipe as it stands",
    "areal train examples/sft_chat.yaml": "+ model.path=<tiny model> trainer.max_steps=2: the command takes "
    "overrides, and the SFT example's full epoch of SmolLM2 would take minutes without checking more",
    "areal inf run": "+ --port <free port>, and 127.0.0.1:8000 -> 127.0.0.1:<that port> in the python line: "
    "8000 may be taken on a shared machine",
    "areal agent run": "+ --port 0 (the command's own option for a free control port): 8100 may be taken",
    "areal agent status --watch": "runs until Ctrl-C: it is sent SIGINT once it shows a finished session",
    "then `areal agent stop`": "run after it, as the comment says",
    "`stop` operate it": "the sentence after the inf block names `areal inf stop`: run at the end of that block",
    "AREAL_HOME": "set to a scratch directory, so the services' state is not the user's ~/.areal",
}

# Commands of the README's bash blocks that this test does not run.
EXCLUDED = {
    "make test": "the whole suite, which this test is part of",
    "pip install areal-ray": "installing is not part of the walkthrough (`make install` did it)",
    "ray start --head": "needs a Ray cluster; plugins/areal-ray/tests run these commands' configs on a two-node "
    "cluster they start",
    "areal plan plugins/areal-ray/examples/grpo_arithmetic_ray.yaml": "needs the Ray cluster above",
    "areal train plugins/areal-ray/examples/grpo_arithmetic_ray.yaml": "needs the Ray cluster above",
    "salloc -N2": "needs a Slurm cluster; plugins/areal-slurm/tests run it on one they start",
    "areal train my.yaml scheduler.type=slurm": "needs a Slurm cluster (a login node)",
}


def bash_blocks() -> list[list[str]]:
    """The README's ```bash blocks, each a list of command lines (backslash
    continuations joined, blank lines dropped; comments kept)."""
    blocks, current, inside = [], [], False
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            if inside:
                blocks.append(current)
                current, inside = [], False
            elif line.strip() == "```bash":
                inside = True
            continue
        if inside:
            if current and current[-1].endswith("\\"):
                current[-1] = current[-1][:-1].rstrip() + " " + line.strip()
            elif line.strip():
                current.append(line.strip())
    return blocks


def argv(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def command_text(line: str) -> str:
    return " ".join(argv(line))


def block_with(prefix: str) -> list[str]:
    found = [b for b in bash_blocks() if any(command_text(line).startswith(prefix) for line in b)]
    assert len(found) == 1, f"README.md: expected one bash block with `{prefix}`, found {len(found)}"
    return found[0]


def excluded(cmd: str) -> bool:
    return any(cmd.startswith(e) for e in EXCLUDED)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class User:
    """A shell in the scratch directory: runs one README command at a time."""

    def __init__(self, cwd: Path, home: Path) -> None:
        self.cwd = cwd
        self.env = {**os.environ, "AREAL_HOME": str(home), "OMP_NUM_THREADS": "1"}
        self.env["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        self.home = home
        self.tiny = ""  # the tiny model's directory (set by the fixture)

    def resolve(self, args: list[str]) -> list[str]:
        if args[0] in ("areal", "python"):
            return [str(BIN / args[0]), *args[1:]]
        return args

    def run(self, args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            self.resolve(args), cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, (
            f"README command `{shlex.join(args)}` failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
        return proc

    def start(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen(
            self.resolve(args), cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip

    def processes(self) -> list:
        """Live processes started for this walkthrough (they inherit its AREAL_HOME)."""
        from areal_kernel.testing.procs import live_processes

        mark = f"AREAL_HOME={self.home}"
        return live_processes(lambda p: p.pid != os.getpid() and p.environ_has(mark))

    def kill_all(self) -> None:
        """Whatever is left, by process group (never by name)."""
        for p in self.processes():
            try:
                os.killpg(p.pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    from areal_kernel.testing.models import make_tiny_chat_llama

    root = tmp_path_factory.mktemp("newcomer")
    cwd, home = root / "work", root / "areal-home"
    cwd.mkdir()
    for name in ("examples", "plugins"):
        (cwd / name).symlink_to(REPO / name)
    tiny = make_tiny_chat_llama(root / "tiny-model")
    cfg = yaml.safe_load((REPO / "examples" / "grpo_arithmetic.yaml").read_text())
    cfg["experiment_name"] = "my-run"
    cfg["model"]["path"] = str(tiny)
    cfg["trainer"].update(max_steps=2, batch_size=2, eval_size=2)
    cfg["rollout"]["gconfig"].update(n_samples=4, max_new_tokens=6)
    cfg["algorithm"]["dynamic_filter"] = False  # a random model's rewards are all 0
    cfg["logging"]["sinks"] = ["console", "jsonl"]
    (cwd / "my.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    u = User(cwd, home)
    u.tiny = str(tiny)
    try:
        yield u
    finally:
        for svc in ("agent", "inf"):
            subprocess.run(u.resolve(["areal", svc, "stop"]), cwd=cwd, env=u.env, capture_output=True, timeout=120)
        left = u.processes()
        u.kill_all()
        assert not left, f"processes left after the walkthrough: {[(p.pid, p.argv[:4]) for p in left]}"


def test_every_readme_command_is_covered():
    """Each command of every bash block is run by a test below or listed in EXCLUDED."""
    run_prefixes = ("make demo", "areal validate", "areal check", "areal plan my.yaml", "areal train my.yaml key",
                    "areal plugins", "areal train examples/sft_chat.yaml", "areal doctor", "areal schema",
                    "areal inf run", "areal inf register", "python -c", "areal agent run", "areal agent status")  # fmt: skip
    commands = [command_text(line) for b in bash_blocks() for line in b]
    assert len(commands) >= 20, commands  # the parser found the README's blocks
    uncovered = [c for c in commands if not excluded(c) and not c.startswith(run_prefixes)]
    assert not uncovered, f"README commands neither run nor excluded here: {uncovered}"
    stale = [e for e in EXCLUDED if not any(c.startswith(e) for c in commands)]
    assert not stale, f"EXCLUDED names commands the README no longer has: {stale}"


def test_using_it_block(user):
    """validate / check / plan / train / plugins / the SFT example / doctor / schema."""
    block = block_with("areal validate")
    done = []
    for line in block:
        args = argv(line)
        text = " ".join(args)
        if excluded(text):
            continue
        if "key.sub=value" in args:
            args = [a for a in args if a not in ("key.sub=value", "...")]
        if "[--json]" in args:
            plain = [a for a in args if a != "[--json]"]
            out = user.run(plain).stdout
            assert "registers:" in out, out
            data = json.loads(user.run([*plain, "--json"]).stdout)
            assert data["plugins"], data
            done.append("plugins")
            continue
        if text.startswith("areal train examples/sft_chat.yaml"):
            args = [*args, f"model.path={user.tiny}", "trainer.max_steps=2"]
        proc = user.run(args)
        out = proc.stdout
        if args[1] == "validate":
            resolved = yaml.safe_load(out)
            overrides = dict(a.split("=", 1) for a in args[3:])
            assert str(resolved["trainer"]["max_steps"]) == overrides["trainer.max_steps"]
            assert str(resolved["rollout"]["max_staleness"]) == overrides["rollout.max_staleness"]
        elif args[1] == "check":
            assert out.strip(), proc.stderr[-2000:]
        elif args[1] == "plan":
            assert "fits: yes" in out, out
        elif args[1] == "train":
            run_dir = user.cwd / "runs" / ("my-run" if args[2] == "my.yaml" else "sft-chat")
            assert (run_dir / "result.json").is_file(), out[-2000:]
        elif args[1] == "doctor":
            assert "problems:" in out, out
        elif args[1] == "schema":
            target = user.cwd / args[args.index("-o") + 1]
            assert "properties" in json.loads(target.read_text())
        done.append(args[1])
    assert sorted(set(done)) == ["check", "doctor", "plan", "plugins", "schema", "train", "validate"], done


def test_make_demo(user):
    """`make demo`'s run, 2 steps instead of 20 on the real SmolLM2-135M."""
    block = block_with("make demo")
    assert any(command_text(line) == "make demo" for line in block)
    # The README's own account of what make demo runs ("`areal train ...`:" opening its list of steps).
    demo = re.findall(r"^`(areal train [^`]+)`:$", README.read_text(encoding="utf-8"), re.MULTILINE)
    assert len(demo) == 1, demo
    out = user.run([*argv(demo[0]), "trainer.max_steps=2", "trainer.eval_size=8"]).stdout
    assert "held-out greedy accuracy: before" in out, out[-3000:]
    run_dir = user.cwd / "runs" / "grpo-arithmetic"
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "result.json"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "checkpoints" / "final").is_dir()
    # The demo ends with the run's report: the Makefile recipe's last command prints the page's path.
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(encoding="utf-8"), re.MULTILINE)
    assert recipe, "the Makefile has no demo recipe"
    last = recipe.group(1).strip().splitlines()[-1].strip()
    assert last.startswith("$(VENV)/bin/areal report "), last
    out = user.run(["areal", *shlex.split(last)[1:]]).stdout
    page = Path(out.strip().splitlines()[-1].removeprefix("report: "))
    assert page == run_dir.resolve() / "report.html" and page.is_file(), out
    # 1 GB of SmolLM2 checkpoints that no later test reads: gone now rather
    # than at the end of the session, which keeps the module's directory.
    shutil.rmtree(run_dir)


def test_inf_block(user):
    """The gateway, a SmolLM2 replica, and the openai one-liner through it; then `areal inf stop`."""
    block = block_with("areal inf run")
    text = README.read_text(encoding="utf-8")
    assert re.search(r"`deregister MODEL` and\s+`stop` operate it", text), "the README no longer names `areal inf stop`"
    port = free_port()
    said = None
    for line in block:
        args = argv(line)
        if args[:3] == ["areal", "inf", "run"]:
            args = [*args, "--port", str(port)]
        if args[0] == "python":
            assert "127.0.0.1:8000" in args[2]
            args = [args[0], args[1], args[2].replace("127.0.0.1:8000", f"127.0.0.1:{port}")]
            said = user.run(args).stdout
            continue
        user.run(args)
    assert said is not None and said.strip(), said
    user.run(["areal", "inf", "stop"])


def test_agent_block(user):
    """N workers of the example agent on SmolLM2; status --watch until a session
    finished (then Ctrl-C), and `areal agent stop`."""
    block = block_with("areal agent run")
    stop_cmd = None
    for line in block:
        args = argv(line)
        m = re.search(r"then `(areal [^`]+)`", line.split("#", 1)[1]) if "#" in line else None
        if m:
            stop_cmd = argv(m.group(1))
        if args[:3] == ["areal", "agent", "run"]:
            user.run([*args, "--port", "0"])
        elif args[:3] == ["areal", "agent", "status"]:
            assert "--watch" in args
            watch = user.start(args)
            seen, finished = [], 0
            deadline = time.monotonic() + 900
            try:
                assert watch.stdout is not None
                for out_line in watch.stdout:
                    seen.append(out_line)
                    m = re.search(r"sessions: \d+ open, (\d+) finished", out_line)
                    if m and int(m.group(1)) >= 1:
                        finished = int(m.group(1))
                        break
                    if time.monotonic() > deadline:
                        break
                watch.send_signal(signal.SIGINT)  # the user's Ctrl-C
                rest, _ = watch.communicate(timeout=60)
            finally:
                if watch.poll() is None:
                    os.killpg(watch.pid, signal.SIGKILL)
                    watch.wait(30)
            assert finished >= 1, "".join(seen)[-3000:]
            assert watch.returncode == 0, rest[-2000:]
        else:
            pytest.fail(f"unexpected command in the agent block: {line}")
    assert stop_cmd == ["areal", "agent", "stop"], stop_cmd
    user.run(stop_cmd)
    left = [p.argv[:4] for p in user.processes() if p.runs("agent")]
    assert not left, f"agent processes left after `areal agent stop`: {left}"
