"""`areal report` and `areal inspect` on run directories of a real `areal train`
run (tiny random model with SmolLM2's tokenizer, 3 steps, one embedded server)
and on copies of it cut the ways runs are left behind: the last line of
metrics.jsonl cut short, samples.jsonl or result.json missing, metrics of an
older version lacking keys, no metrics at all.

The whole file took 39 s of CPU (user + system, the run's processes
included; the run alone 19 s). Its wall clock was 109 s on two cores shared
with other work (load 7), the run most of it."""

from __future__ import annotations

import base64
import io
import json
import re
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from areal_kernel.cli import main
from areal_kernel.report.panels import PANELS
from areal_kernel.testing.recovery import trained_steps
from areal_kernel.utils import prefork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "grpo_arithmetic.yaml")
STEPS = 3
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "result.json", "server-0.log")


@pytest.fixture(scope="module")
def run_dir(areal_tiny_chat_model_dir, tmp_path_factory):
    """One real, finished run shared by the module's tests (never modified: tests copy it)."""
    run = str(tmp_path_factory.mktemp("report") / "run")
    proc = areal(
        "train", EXAMPLE,
        f"model.path={areal_tiny_chat_model_dir}", f"run_dir={run}", f"trainer.max_steps={STEPS}",
        "trainer.batch_size=2", "trainer.eval_size=4", "rollout.gconfig.n_samples=2",
        "rollout.gconfig.max_new_tokens=4", "algorithm.dynamic_filter=false", "logging.sinks=[jsonl]",
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def areal(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """The `areal` command in a fresh process (the run_areal fixture's, usable from a module-scoped fixture)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return prefork.run(
        [sys.executable, "-m", "areal_kernel.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def copy_run(src: str, dst: str, leave_out: tuple[str, ...] = ()) -> str:
    os.makedirs(dst)
    for name in RUN_FILES:
        if name not in leave_out:
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst


class Page(HTMLParser):
    """The parts of a report page the tests look at: per panel section its
    images and its "missing" lines; the whole text."""

    def __init__(self) -> None:
        super().__init__()
        self.panels: dict[str, dict[str, list[str]]] = {}
        self.section: str | None = None
        self.in_missing = False
        self.text: list[str] = []
        self.title = ""
        self.in_title = False
        self.external: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" and a.get("class") == "panel":
            self.section = a["id"].removeprefix("panel-")
            self.panels[self.section] = {"img": [], "missing": []}
        elif tag == "img" and self.section:
            self.panels[self.section]["img"].append(a["src"])
        elif tag == "p" and a.get("class") == "missing":
            self.in_missing = True
            if self.section:
                self.panels[self.section]["missing"].append("")
        elif tag == "title":
            self.in_title = True
        for key in ("src", "href"):
            if a.get(key) and not a[key].startswith("data:"):
                self.external.append(a[key])
        if tag in ("script", "link"):
            self.external.append(tag)

    def handle_endtag(self, tag):
        if tag == "section":
            self.section = None
        elif tag == "p":
            self.in_missing = False
        elif tag == "title":
            self.in_title = False

    def handle_data(self, data):
        self.text.append(data)
        if self.in_title:
            self.title += data
        if self.in_missing and self.section:
            self.panels[self.section]["missing"][-1] += data

    @property
    def all_text(self) -> str:
        return " ".join(" ".join(self.text).split())


def report(capsys, *args: str) -> tuple[Page, str]:
    code = main(["report", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    path = out.out.strip().splitlines()[-1].removeprefix("report: ")
    page = Page()
    with open(path, encoding="utf-8") as f:
        page.feed(f.read())
    return page, out.err


def coloured_pixels(src: str) -> int:
    """Pixels of a clearly non-grey colour: the plotted series (axes, ticks,
    grid and text are black or grey; an empty plot has none)."""
    from PIL import Image

    assert src.startswith("data:image/png;base64,"), src[:40]
    img = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB")
    assert img.width > 100 and img.height > 100
    colours = img.getcolors(maxcolors=img.width * img.height)
    assert len(colours) > 1, "a blank image"
    return sum(n for n, (r, g, b) in colours if max(r, g, b) - min(r, g, b) > 60)


def test_report_of_a_finished_run(run_dir, capsys, tmp_path):
    page, err = report(capsys, run_dir, "-o", str(tmp_path / "r.html"))
    assert not page.external, page.external  # self-contained
    assert page.title == "areal report: run"
    assert set(page.panels) == {p.id for p in PANELS}
    for pid, panel in page.panels.items():  # every panel has data (monitor/*: the mismatch monitor's)
        assert len(panel["img"]) == 1 and not panel["missing"], (pid, panel)
        assert coloured_pixels(panel["img"][0]) > 50, f"panel {pid}: no series drawn"
    text = page.all_text
    assert "finished: result.json written" in text and "What is missing" not in text
    assert f"{STEPS} (1..{STEPS})" in text  # trained steps
    assert "server-0.log" in text and "1 start(s), 0 restart(s)" in text
    samples = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))]
    assert [s["step"] for s in samples] == list(range(1, STEPS + 1))
    # Best and worst steps list their trained sample ids from samples.jsonl.
    rewards = {r["step"]: r["rollout/reward_mean"] for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
               if r.get("rollout/reward_mean") is not None}  # fmt: skip
    for end in (max, min):
        ends = [s for s in samples if rewards.get(s["step"]) == end(rewards.values())]
        assert any(all(uid in text for uid in s["uids"]) for s in ends), (end, ends, rewards)
    assert "algorithm.type" in text and "grpo" in text
    # The example trains with recompute_proximal: false; the mismatch panel says which series carry the gap.
    assert "algorithm.recompute_proximal is false" in text
    assert not err


def test_partial_last_line_and_missing_files(run_dir, capsys, tmp_path):
    cut = copy_run(run_dir, str(tmp_path / "cut"), leave_out=("samples.jsonl", "result.json"))
    path = os.path.join(cut, "metrics.jsonl")
    lines = open(path).read().splitlines(keepends=True)
    last_step = max(i for i, line in enumerate(lines) if "perf/step_s" in line)
    # A kill while writing the last step's line: everything after it gone, the line half there.
    kept = "".join(lines[:last_step]) + lines[last_step][: len(lines[last_step]) // 2]
    open(path, "w").write(kept)
    page, err = report(capsys, cut)
    assert os.path.isfile(os.path.join(cut, "report.html"))
    text = page.all_text
    assert f"line(s) {last_step + 1} unreadable and left out (the last one cut short" in text
    assert "no samples.jsonl" in text and "no result.json: the run is still going" in text
    assert f"{STEPS - 1} (1..{STEPS - 1})" in text
    assert trained_steps(cut) == list(range(1, STEPS))  # the kill-and-resume tests' reader: the same lines
    assert "not recorded" in text  # the steps table has no sample ids
    for pid in ("reward", "staleness", "throughput"):
        assert page.panels[pid]["img"] and coloured_pixels(page.panels[pid]["img"][0]) > 50, pid
    assert "no result.json" in err  # said on the terminal too


def test_older_version_without_keys(run_dir, capsys, tmp_path):
    old = copy_run(run_dir, str(tmp_path / "old"))
    path = os.path.join(old, "metrics.jsonl")
    gone = ("train/", "rollout/staleness", "weights/", "mismatch/", "monitor/")  # keys this version added
    rows = [json.loads(line) for line in open(path)]
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({k: v for k, v in r.items() if not k.startswith(gone)}) + "\n")
    page, _ = report(capsys, old)
    for pid, needs in (("mismatch", "train/behav_imp_weight"), ("staleness", "rollout/staleness_mean"),
                       ("weights", "weights/pause_s")):  # fmt: skip
        assert not page.panels[pid]["img"], pid
        assert needs in page.panels[pid]["missing"][0], page.panels[pid]
    assert page.panels["reward"]["img"] and coloured_pixels(page.panels["reward"]["img"][0]) > 50


def test_run_without_any_file(capsys, tmp_path):
    empty = tmp_path / "starting"
    empty.mkdir()
    page, _ = report(capsys, str(empty))
    assert all(not p["img"] and p["missing"] for p in page.panels.values()), page.panels
    assert "no metrics.jsonl" in page.all_text and "no config.yaml" in page.all_text


def test_unwritable_output_is_one_error_line(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "run").mkdir()
    assert main(["report", str(tmp_path / "run"), "-o", str(blocker / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"areal: error: areal report: cannot write {blocker / 'r.html'}: ") and err.count("\n") == 1, err
    assert "choose another file with -o" in err


def test_compare_overlays_both_runs(run_dir, capsys, tmp_path):
    # The second run: the same steps, but an older version's metrics without the loss's statistics.
    other = copy_run(run_dir, str(tmp_path / "other-run"))
    path = os.path.join(other, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)]
    with open(path, "w") as f:
        f.writelines(json.dumps({k: v for k, v in r.items() if not k.startswith("train/")}) + "\n" for r in rows)
    page, _ = report(capsys, "--compare", run_dir, other, "-o", str(tmp_path / "c.html"))
    assert page.title == "areal report: run vs other-run"
    words = page.all_text.split()
    assert "run" in words and "other-run" in words  # the runs table names both
    single, _ = report(capsys, run_dir, "-o", str(tmp_path / "s.html"))
    for pid in ("reward", "throughput"):
        # Both runs' series and legend entries: more coloured pixels than the first run alone.
        assert coloured_pixels(page.panels[pid]["img"][0]) > coloured_pixels(single.panels[pid]["img"][0]), pid
    # The mismatch panel draws the first run and says which metrics the second lacks.
    assert page.panels["mismatch"]["img"]
    assert "Not logged: other-run: train/behav_imp_weight" in page.all_text


def test_missing_directory_is_one_error_line(tmp_path):
    proc = areal("report", str(tmp_path / "nope"), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"areal: error: run directory {str(tmp_path / 'nope')!r} does not exist "
        "(give the run_dir of an `areal train` run)"
    ]


def test_every_trained_sample_records_its_provenance(run_dir):
    import yaml

    staleness = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))["rollout"]["max_staleness"]
    log = open(os.path.join(run_dir, "server-0.log")).read()
    server = re.search(r"listening on http://([0-9.]+:[0-9]+)", log).group(1)
    records = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        samples = r["samples"]
        assert len(samples) == 4, r  # 2 prompts x 2 samples
        assert sorted({s["uid"] for s in samples}) == sorted(r["uids"]), r
        assert len({s["sample"] for s in samples}) == 4, r
        trained = r["version"] - 1  # the weights the step trained from
        for s in samples:
            # The versions of its tokens: within the staleness bound of the weights it trained.
            assert s["versions"] and all(trained - staleness <= v <= trained for v in s["versions"]), (r, s)
            assert s["server"] == server and s["tokens"] >= 1 and 0.0 <= s["reward"] <= 1.0, s
    assert any(v < r["version"] - 1 for r in records for s in r["samples"] for v in s["versions"]), (
        "no sample was one version old: the run did not overlap generation and training"
    )


def test_inspect_prints_a_steps_samples(run_dir, capsys):
    record = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))][1]
    assert main(["inspect", run_dir, "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert f"step 2: weight version after the step {record['version']}" in out
    assert f"{len(record['samples'])} trained sample(s):" in out
    for s in record["samples"]:
        assert f"    sample: {s['sample']}" in out and f"    server: {s['server']}" in out
    assert "not in this run's samples.jsonl" not in out


def test_inspect_of_an_older_run_says_what_it_lacks(run_dir, capsys, tmp_path):
    old = copy_run(run_dir, str(tmp_path / "old"))
    path = os.path.join(old, "samples.jsonl")
    records = [json.loads(line) for line in open(path)]
    with open(path, "w") as f:  # before per-sample provenance: ids only
        for r in records:
            f.write(json.dumps({k: r[k] for k in ("step", "version", "uids")}) + "\n")
    assert main(["inspect", old, "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert [line.strip() for line in out.splitlines() if line.startswith("  ")] == records[1]["uids"]
    assert "not in this run's samples.jsonl" in out


def test_inspect_prints_per_sample_records(tmp_path, capsys):
    # A run whose samples.jsonl records each sample (what the provenance work adds) is printed field by field.
    run = tmp_path / "run"
    run.mkdir()
    sample = {"uid": "e0-7", "prompt": "What is 2+3?", "completion": "5", "reward": 1.0, "versions": [3, 3, 4],
              "server": "127.0.0.1:8000"}  # fmt: skip
    (run / "samples.jsonl").write_text(json.dumps({"step": 4, "version": 5, "samples": [sample]}) + "\n")
    assert main(["inspect", str(run), "--step", "4"]) == 0
    out = capsys.readouterr().out
    for key, value in sample.items():
        assert f"    {key}: {value}" in out, key
    assert "metrics: none logged for this step" in out


def test_inspect_bad_step_names_the_range(run_dir):
    proc = areal("inspect", run_dir, "--step", str(STEPS + 1), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"areal: error: step {STEPS + 1} is not in samples.jsonl of {run_dir}: valid steps are 1..{STEPS}"
    ]


def test_monitoring_doc_names_every_plotted_metric():
    doc = open(os.path.join(REPO, "docs", "monitoring.md"), encoding="utf-8").read()
    missing = [s.key for p in PANELS for s in p.series if f"`{s.key}`" not in doc and s.derive is None]
    missing += [f"{prefix}*" for p in PANELS for prefix in p.prefixes if f"`{prefix}*`" not in doc]
    assert not missing, f"docs/monitoring.md does not explain: {missing}"
