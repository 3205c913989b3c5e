"""The bad-input table: each case is a real ``areal`` command on a broken
input, and ``docs/bad-inputs.md`` shows the message the CLI prints for it.

``python tests/faults/bad_inputs.py --write`` reruns every case and rewrites
the doc; ``tests/faults/test_bad_inputs.py`` fails when the doc and the CLI
drift apart. Paths, ports and the working directory are normalised
(``<tmp>``, ``<port>``) so the doc does not depend on where it ran.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from areal_kernel.utils import prefork

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "bad-inputs.md"


@dataclass
class Ctx:
    """One case's scratch directory plus what the message should not leak."""

    tmp: Path
    subs: dict[str, str] = field(default_factory=dict)  # literal -> placeholder in the doc
    env: dict[str, str] = field(default_factory=dict)
    keep: list[Any] = field(default_factory=list)  # objects held open while the command runs (a bound socket)

    def write(self, name: str, text: str | bytes) -> str:
        p = self.tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text, encoding="utf-8")
        return name


@dataclass(frozen=True)
class Case:
    id: str
    what: str  # the bad input, in words, for the doc
    setup: Callable[[Ctx], list[str]]  # creates files under ctx.tmp, returns the CLI arguments
    expect: tuple[str, ...]  # fragments the message must contain (the field/file/plugin and what is valid)


def _fake_model(ctx: Ctx) -> str:
    """A directory that passes the model-path check (config.json only): enough
    for errors that come before any weights or tokenizer are read."""
    ctx.write("model/config.json", "{}\n")
    return "model"


def _data(ctx: Ctx, name: str, text: str) -> list[str]:
    ctx.write(name, text)
    return ["check", "/dev/null", f"model.path={_fake_model(ctx)}", "dataset.type=file", f"dataset.path={name}"]


def _broken_plugin(ctx: Ctx) -> list[str]:
    """A real installed distribution (dist-info with an ``areal.plugins`` entry
    point, found by importlib.metadata) whose module fails to import."""
    site = ctx.tmp / "site"
    (site / "areal_fault_broken").mkdir(parents=True)
    (site / "areal_fault_broken" / "__init__.py").write_text("")
    (site / "areal_fault_broken" / "plugin.py").write_text("import areal_fault_missing_dependency  # noqa\n")
    info = site / "areal_fault_broken-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: areal-fault-broken\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[areal.plugins]\nfaultplug = areal_fault_broken.plugin\n")
    ctx.env["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return ["validate", "/dev/null", "reward.type=faultplug"]


def _dataset_plugin(body: str) -> Callable[[Ctx], list[str]]:
    """A real installed distribution (as in ``_broken_plugin``) registering
    dataset ``faultdata``, whose source ``(config, seed, required)`` is
    ``body``; the command is ``areal check`` with it selected."""

    def setup(ctx: Ctx) -> list[str]:
        site = ctx.tmp / "site"
        (site / "areal_fault_data").mkdir(parents=True)
        (site / "areal_fault_data" / "__init__.py").write_text("")
        (site / "areal_fault_data" / "plugin.py").write_text(
            "from areal_kernel import hookimpl\n\n\n"
            "@hookimpl\n"
            "def areal_register_datasets(register):\n"
            "    register('faultdata', 'areal_fault_data.plugin:source')\n\n\n"
            "def source(config, seed, required):\n"
            "    records = [{'id': f'q{i}', 'prompt': f'{i}+1', 'answer': str(i + 1)} for i in range(4)]\n"
            f"    {body}\n"
        )
        info = site / "areal_fault_data-0.0.2.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: areal-fault-data\nVersion: 0.0.2\n")
        (info / "entry_points.txt").write_text("[areal.plugins]\nfaultdata = areal_fault_data.plugin\n")
        ctx.env["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return ["check", "/dev/null", f"model.path={_fake_model(ctx)}", "dataset.type=faultdata"]

    return setup


def _taken_port(ctx: Ctx) -> list[str]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    ctx.keep.append(s)
    port = s.getsockname()[1]
    ctx.subs[str(port)] = "<port>"
    return ["check", "/dev/null", "-n", "1", f"rollout.embedded.port={port}"]


def _existing_run(ctx: Ctx) -> list[str]:
    """A run directory with a checkpoint and metrics from an earlier run; the
    new run is pointed at a dataset that does not exist."""
    ctx.write("run/checkpoints/step2/model.safetensors", b"earlier weights")
    ctx.write("run/metrics.jsonl", '{"step": 1}\n{"step": 2}\n')
    return ["train", "/dev/null", "run_dir=run", "dataset.type=file", "dataset.path=gone.jsonl", "trainer.max_steps=1"]


def _v(*overrides: str) -> Callable[[Ctx], list[str]]:
    return lambda ctx: ["validate", "/dev/null", *overrides]


def _without_plugins(keep: str, *overrides: str) -> Callable[[Ctx], list[str]]:
    """Every plugin of this repository is installed by `make install`; leaving
    all but ``keep`` out through AREAL_PLUGINS shows what a machine without
    them gets."""

    def setup(ctx: Ctx) -> list[str]:
        ctx.env["AREAL_PLUGINS"] = keep
        return ["validate", "/dev/null", *overrides]

    return setup


def _yaml(text: str | bytes, name: str = "c.yaml") -> Callable[[Ctx], list[str]]:
    return lambda ctx: ["validate", ctx.write(name, text)]


CASES: list[Case] = [
    # -- the YAML file itself
    Case("yaml-indent", "YAML with a mis-indented key (line 3)",
         _yaml("trainer:\n  batch_size: 2\n   max_steps: 3\n"), ("c.yaml:3:", "invalid YAML")),
    Case("yaml-tab", "YAML indented with a tab", _yaml("trainer:\n\tbatch_size: 2\n"), ("c.yaml:2:", "invalid YAML")),
    Case("yaml-list", "YAML whose top level is a list", _yaml("- trainer\n- actor\n"), ("c.yaml", "mapping of sections")),
    Case("yaml-binary", "config file that is not UTF-8 text", _yaml(b"\xff\xfe\x00junk"), ("c.yaml", "UTF-8")),
    Case("config-missing", "config file that does not exist", lambda ctx: ["validate", "nope.yaml"],
         ("nope.yaml", "not found")),
    Case("config-dir", "config path that is a directory",
         lambda ctx: (ctx.tmp.joinpath("confdir").mkdir(), ["validate", "confdir"])[1], ("confdir", "directory")),
    # -- keys, types, ranges
    Case("unknown-section", "unknown top-level key `trainr`", _yaml("trainr:\n  batch_size: 2\n"),
         ("trainr", "did you mean 'trainer'")),
    Case("unknown-key", "unknown key `trainer.batchsize` in the file", _yaml("trainer:\n  batchsize: 2\n"),
         ("trainer.batchsize", "did you mean 'batch_size'")),
    Case("unknown-plugin-key", "unknown key in a plugin's section", _v("rollout.embedded.bogus=1"),
         ("rollout.embedded.bogus", "valid keys:", "max_batch_size")),
    Case("wrong-type", "`trainer.batch_size: abc`", _yaml("trainer:\n  batch_size: abc\n"),
         ("trainer.batch_size", "valid integer", "'abc'")),
    Case("out-of-range", "`trainer.batch_size: 0`", _yaml("trainer:\n  batch_size: 0\n"),
         ("trainer.batch_size", "greater than or equal to 1")),
    Case("negative-temperature", "`rollout.gconfig.temperature: -1`",
         _yaml("rollout:\n  gconfig:\n    temperature: -1\n"), ("rollout.gconfig.temperature", "greater than 0")),
    Case("bad-choice", "`model.dtype: float16` (not offered)", _v("model.dtype=float16"),
         ("model.dtype", "'float32' or 'bfloat16'")),
    Case("bad-weight-mode", "`weight_update.mode: nccl`", _v("weight_update.mode=nccl"),
         ("weight_update.mode", "'auto', 'disk' or 'broadcast'")),
    Case("section-not-mapping", "a section given a number (`trainer: 5`)", _v("trainer=5"),
         ("trainer", "valid dictionary")),
    Case("path-unsafe-name", "`experiment_name: a/b`", _v("experiment_name=a/b"), ("experiment_name", "'/'")),
    Case("file-dataset-no-path", "`dataset.type: file` without `dataset.path`", _v("dataset.type=file"),
         ("dataset.path is required",)),
    # -- overrides
    Case("override-no-equals", "override without `=`", _v("trainer.batch_size"),
         ("trainer.batch_size", "key.sub=value")),
    Case("override-bad-yaml", "override whose value is broken YAML", _v("trainer.batch_size=[1"),
         ("trainer.batch_size=[1", "not valid YAML")),
    Case("override-unknown-key", "override of an unknown key", _v("trainer.bath_size=3"),
         ("trainer.bath_size", "did you mean 'batch_size'")),
    Case("unknown-option", "unknown command-line option", _v("--bogus"), ("unrecognized arguments: --bogus",)),
    # -- registered names, plugins, allocations
    Case("backend-not-installed", "`actor.backend: megatron` (plugin not loaded: `AREAL_PLUGINS=fsdp`, as where "
         "areal-megatron is not installed)", _without_plugins("fsdp", "actor.backend=megatron"),
         ("actor.backend", "Available:", "pip install areal-megatron")),
    Case("backend-unknown", "`rollout.backend: tensorrt` (no such backend)", _v("rollout.backend=tensorrt"),
         ("rollout.backend", "Available:")),
    Case("allocation-syntax", "allocation `embedded:dx`", _v("rollout.backend=embedded:dx"),
         ("rollout.backend", "'d2', 'd2t1'")),
    Case("allocation-zero", "allocation `torch:d0`", _v("actor.backend=torch:d0"), ("actor.backend", ">= 1")),
    Case("reward-unknown", "`reward.type: nonexist`", _v("reward.type=nonexist"), ("reward.type", "Available:")),
    Case("dataset-unknown", "`dataset.type: foo`", _v("dataset.type=foo"), ("dataset.type", "Available:")),
    Case("workflow-unknown", "`workflow.type: bar`", _v("workflow.type=bar"), ("workflow.type", "Available:")),
    Case("advantage-unknown", "`algorithm.advantage: zzz`", _v("algorithm.advantage=zzz"),
         ("algorithm.advantage", "registered:")),
    Case("sink-unknown", "`logging.sinks: [wandbx]`", _v("logging.sinks=[wandbx]"), ("logging.sinks", "registered:")),
    # -- settings sections of estimators, losses and metric sinks
    Case("sink-settings-bad-choice", "`logging.wandb.mode: cloud` (not offered)",
         _v("logging.sinks=[wandb]", "logging.wandb={mode: cloud}"),
         ("logging.wandb.mode", "'online', 'offline' or 'disabled'")),
    Case("sink-settings-unknown-key", "unknown key `logging.wandb.projct`",
         _v("logging.sinks=[wandb]", "logging.wandb={projct: x}"), ("logging.wandb.projct", "did you mean 'project'")),
    Case("sink-settings-not-listed", "`logging.wandb` settings while `wandb` is not in `logging.sinks`",
         _v("logging.sinks=[console]", "logging.wandb={project: x}"), ("logging.wandb", "logging.sinks: console")),
    Case("sink-settings-none-declared", "settings for a sink that declares none (`logging.jsonl`)",
         _v("logging.sinks=[jsonl]", "logging.jsonl={path: x}"), ("logging.jsonl", "takes no settings")),
    Case("loss-settings-none-declared", "settings for a loss that declares none (`algorithm.ppo`)",
         _v("algorithm.ppo={eps_clip: 0.1}"), ("algorithm.ppo", "takes no settings")),
    Case("algorithm-section-unknown", "`algorithm.gpro: {...}` (typo of the selected estimator)",
         _v("algorithm.gpro={x: 1}"), ("algorithm.gpro", "did you mean 'grpo'")),
    Case("algorithm-kwargs-removed", "the removed `algorithm.loss_kwargs`", _v("algorithm.loss_kwargs={x: 1}"),
         ("algorithm.loss_kwargs", "algorithm.ppo")),
    Case("plugin-import-fails", "a plugin that is installed but fails to import, then selected", _broken_plugin,
         ("reward.type", "faultplug", "failed to load", "areal_fault_missing_dependency")),
    # -- model path (areal check)
    Case("model-missing", "`model.path` that does not exist", lambda ctx: ["check", "/dev/null", "model.path=no/such/model"],
         ("model.path", "no/such/model", "Known models:")),
    Case("model-empty", "`model.path: ''`", lambda ctx: ["check", "/dev/null", "model.path="], ("model.path", "non-empty")),
    Case("model-is-file", "`model.path` that is a file",
         lambda ctx: ["check", "/dev/null", f"model.path={ctx.write('w.bin', b'x')}"], ("model.path", "is a file", "config.json")),
    Case("model-no-config", "`model.path` directory without config.json",
         lambda ctx: (ctx.tmp.joinpath("m").mkdir(), ["check", "/dev/null", "model.path=m"])[1], ("model.path", "config.json")),
    # -- dataset files (areal check)
    Case("data-missing", "dataset file that does not exist",
         lambda ctx: ["check", "/dev/null", f"model.path={_fake_model(ctx)}", "dataset.type=file", "dataset.path=gone.jsonl"],
         ("gone.jsonl", "does not exist", ".jsonl/.json/.parquet/.csv")),
    Case("data-empty", "empty dataset file", lambda ctx: _data(ctx, "empty.jsonl", ""), ("empty.jsonl", "empty")),
    Case("data-bad-json", "dataset with a broken JSON line (line 2)",
         lambda ctx: _data(ctx, "bad.jsonl", '{"prompt": "1+1", "answer": "2"}\n{bad\n'), ("bad.jsonl", "line 2")),
    Case("data-no-prompt", "dataset records without the workflow's `prompt` field",
         lambda ctx: _data(ctx, "q.jsonl", '{"question": "1+1", "answer": "2"}\n'), ("q.jsonl", "'prompt'", "field_map")),
    Case("data-no-answer", "dataset records without the reward's `answer` field",
         lambda ctx: _data(ctx, "p.jsonl", '{"prompt": "1+1", "solution": "2"}\n'),
         ("p.jsonl", "'answer'", "field_map={'solution': 'answer'}")),
    Case("data-extension", "dataset file with an unsupported extension",
         lambda ctx: _data(ctx, "d.txt", "1+1,2\n"), ("d.txt", "supported: .jsonl")),
    # -- plugin datasets and plugin code (areal check)
    Case("plugin-dataset-shape", "a plugin dataset that returns a dict instead of a list of records",
         _dataset_plugin("return {'train': records}"),
         ("dataset 'faultdata'", "plugin 'faultdata' (areal-fault-data 0.0.2)", "returned a dict", "list of record dicts")),
    Case("plugin-dataset-no-answer", "a plugin dataset whose record 1 lacks the workflow's `answer` field",
         _dataset_plugin("del records[1]['answer']; return records"),
         ("dataset 'faultdata'", "areal-fault-data 0.0.2", ": record 1 ", "'answer'", "workflow 'rlvr'")),
    Case("plugin-dataset-duplicate-id", "a plugin dataset with two records of the same `id`",
         _dataset_plugin("records[3]['id'] = 'q0'; return records, []"),
         ("dataset 'faultdata'", "train records 0 and 3", "'q0'", "unique")),
    Case("plugin-code-raises", "plugin code (a dataset) that raises a plain `ValueError`",
         _dataset_plugin("raise ValueError('no records today')"),
         ("dataset 'faultdata' of plugin 'faultdata' (areal-fault-data 0.0.2)", "ValueError: no records today",
          "areal_fault_data/plugin.py", "error.log")),
    # -- servers and runs
    Case("port-taken", "`rollout.embedded.port` already taken by another process", _taken_port,
         ("rollout.embedded.port", "already in use", "leave it unset")),
    Case("existing-run-bad-data", "`areal train` into a run dir holding a checkpoint and metrics, with a missing dataset",
         _existing_run, ("gone.jsonl", "does not exist")),
    Case("multi-policy-run", "`actor.torch.adapters` set by hand in `areal train` (several policies come from `policies:`)",
         lambda ctx: ["train", "/dev/null", "run_dir=run", "actor.torch.adapters=[{name: a}, {name: b}]",
                      "trainer.max_steps=1"],
         ("actor.torch.adapters", "declare several policies under policies:", "actor.torch.lora")),
    # -- role environments
    Case("vllm-python-missing", "`rollout.vllm.python` naming no interpreter",
         _v("rollout.backend=vllm", "rollout.vllm.python=/nope/bin/python"),
         ("rollout.vllm.python", "'/nope/bin/python' is not an executable python", "areal env create vllm")),
    Case("vllm-env-unknown", "`rollout.vllm.python` naming a managed environment that was never created",
         _v("rollout.backend=vllm", "rollout.vllm.python=vllm2"),
         ("rollout.vllm.python", "no managed environment 'vllm2'", "areal env create vllm2")),
    Case("algorithm-type-unknown", "`algorithm.type` naming no registered trainer (a loss's name)",
         _v("algorithm.type=ppo"), ("algorithm.type", "no trainer named 'ppo'", "Available: dpo, grpo, ipo, rm, sft",
                                    "algorithm.loss: ppo")),
    # Plain YAML keeps the second of two equal keys silently: the first block would be lost.
    Case("yaml-duplicate-key", "YAML with a section written twice (`rollout:` at lines 1 and 5)",
         _yaml("rollout:\n  max_staleness: 1\ntrainer:\n  batch_size: 2\nrollout:\n  max_staleness: 3\n"),
         ("c.yaml:5:1", "duplicate key 'rollout'", "first written at line 1")),
    # Several policies (docs/multi-policy.md): caught before any server starts.
    Case("policy-weight-zero", "a policy of `policies:` with `weight: 0`",
         _v("policies={add: {}, sub: {weight: 0}}"), ("policies.sub.weight", "greater than 0")),
    Case("policy-target-missing", "a policy's adapter on a module the model does not have",
         lambda ctx: ["train", "/dev/null", "run_dir=run", "trainer.max_steps=1",
                      "policies={add: {}, sub: {lora: {target_modules: [nope_proj]}}}"],
         ("policies.sub.lora.target_modules", "nope_proj")),
]


def run_cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    """The same command line as the ``run_areal`` fixture, started the same
    way: through the test process's prefork server when ``PREFORK_ENV`` names
    one (a fork that runs the CLI exactly as a fresh interpreter would, with
    torch, transformers, pydantic and yaml already imported: the ``train``
    and port cases import torch, ~7 s of CPU each as plain starts), a plain
    start otherwise (``--write`` outside pytest)."""
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env)
    return prefork.run(
        [sys.executable, "-m", "areal_kernel.cli", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=str(cwd),
    )


@dataclass
class Result:
    case: Case
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    message: str  # stderr normalised for the doc
    ctx: Ctx


def normalise(text: str, ctx: Ctx) -> str:
    for literal, placeholder in ctx.subs.items():
        text = text.replace(literal, placeholder)
    text = text.replace(str(ctx.tmp.resolve()), "<tmp>").replace(str(ctx.tmp), "<tmp>")
    return text.strip()


def run_case(case: Case, root: Path) -> Result:
    tmp = root / case.id
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(tmp)
    try:
        args = case.setup(ctx)
        proc = run_cli(args, tmp, ctx.env)
    finally:
        for obj in ctx.keep:
            obj.close()
    return Result(case, args, proc.returncode, proc.stdout, proc.stderr, normalise(proc.stderr, ctx), ctx)


def run_all(root: Path, workers: int = 4) -> dict[str, Result]:
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda c: run_case(c, root), CASES))
    return {r.case.id: r for r in results}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def render(results: dict[str, Result]) -> str:
    lines = [
        "# Bad inputs and what `areal` says",
        "",
        "Every row is a real `areal` command run on a broken input by",
        "`tests/faults/test_bad_inputs.py`, which fails if this table and the CLI drift apart.",
        "Each exits with code 2 and prints this message on stderr, with no traceback",
        "(`areal --debug ...` adds it). `<tmp>` is the case's scratch directory (the command's",
        "working directory), `<port>` a port held by another process.",
        "Regenerate with `python tests/faults/bad_inputs.py --write`.",
        "",
        "| # | Bad input | Command | Message |",
        "|---|---|---|---|",
    ]
    for i, case in enumerate(CASES, 1):
        r = results[case.id]
        cmd = normalise("areal " + " ".join(r.args), r.ctx)
        lines.append(f"| {i} | {_cell(case.what)} | `{_cell(cmd)}` | {_cell(r.message)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="areal-bad-inputs-") as root:
        results = run_all(Path(root))
        text = render(results)
    if "--write" in argv:
        DOC.write_text(text, encoding="utf-8")
        print(f"wrote {DOC} ({len(CASES)} cases)")
    else:
        print(text)
    bad = [r.case.id for r in results.values() if r.returncode != 2]
    if bad:
        print("cases that did not exit with 2: " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
