"""Drawing the run report: one self-contained HTML page.

The plots are PNG images drawn with matplotlib (Agg backend: no display) and
embedded as base64 ``data:`` URLs; the page has no script and no external
style sheet, so it opens the same offline, attached to an issue or copied
off the machine. One run, or two overlaid on the same axes (``--compare``):
the first run drawn with solid lines, the second dashed.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import os
from typing import Any, Sequence

from areal_kernel import __version__
from areal_kernel.report.panels import CONFIG_SUMMARY, PANELS, RANK_KEYS, Panel, Series
from areal_kernel.report.rundir import RunData

# Distinguishes the runs of a comparison; the series keep their colour.
RUN_STYLES: tuple[dict[str, Any], ...] = (
    {"linestyle": "-", "marker": "o"},
    {"linestyle": "--", "marker": "s"},
)
BEST_WORST = 3  # steps listed at each end
MAX_UIDS = 12  # sample ids listed per step (the rest counted)

STYLE = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 1000px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.9em; } td, th { border: 1px solid #ccc; padding: 2px 6px;
 text-align: left; vertical-align: top; }
.missing { color: #a33; } .note { color: #555; font-size: 0.9em; } .diff { background: #fff3c4; }
img { max-width: 100%; } pre { background: #f6f6f6; padding: 0.5em; font-size: 0.8em; overflow-x: auto; }
code { font-size: 0.9em; }
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _labels(runs: Sequence[RunData]) -> list[str]:
    """Names the runs are told apart by (their directory names; the full
    paths when those are equal)."""
    names = [r.name for r in runs]
    return [r.path for r in runs] if len(set(names)) < len(names) else names


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def render_panel(panel: Panel, runs: Sequence[RunData], labels: Sequence[str]) -> str:
    """One panel's HTML: its plot, or a line saying which metrics it needs;
    series that some run did not log are named under the plot."""
    import logging

    # matplotlib builds its font cache on a machine's first use and logs that
    # at INFO, which the areal CLI's log handler shows: a stray line on a
    # user's terminal (and on stderr, which scripts read) for no fault.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    drawn = 0
    image = ""
    absent: list[str] = []
    fig, ax = plt.subplots(figsize=(8.5, 3.6), dpi=90)
    try:
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        keys: list[str] = []
        for run in runs:
            keys.extend(s.key for s in panel.all_series(run) if s.key not in keys)
        for r, (run, label) in enumerate(zip(runs, labels)):
            style = RUN_STYLES[r % len(RUN_STYLES)]
            by_key = {s.key: s for s in panel.all_series(run)}
            for key in keys:
                series: Series = by_key.get(key) or Series(key, key)
                xs, ys = series.values(run)
                if not xs:
                    absent.append(f"{label}: {key}" if len(runs) > 1 else key)
                    continue
                name = series.label if len(runs) == 1 else f"{label}: {series.label}"
                ax.plot(
                    xs,
                    ys,
                    label=name,
                    color=colours[keys.index(key) % len(colours)],
                    # Long runs: a marker per step would hide the line.
                    marker=series.marker or (style["marker"] if series.points or len(xs) <= 60 else None),
                    markersize=7 if series.points else 3,
                    linestyle="none" if series.points else style["linestyle"],
                )
                drawn += 1
        if drawn:
            ax.set_xlabel("step")
            ax.set_ylabel(panel.ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            image = _png(fig)
    finally:
        plt.close(fig)
    parts = [f'<section class="panel" id="panel-{_e(panel.id)}"><h2>{_e(panel.title)}</h2>']
    if not drawn:
        which = " and ".join(f"'{lab}'" for lab in labels)
        parts.append(f'<p class="missing">No data in {which}: this plot needs {_e(panel.needs)}.</p>')
    else:
        parts.append(f'<img alt="{_e(panel.title)}" src="data:image/png;base64,{image}">')
        if absent:
            parts.append(f'<p class="note">Not logged: {_e(", ".join(absent))}.</p>')
    for run, label in zip(runs, labels):
        said = panel.explain(run) if panel.explain is not None else None
        if said:
            parts.append(f'<p class="note">{_e(label) + ": " if len(runs) > 1 else ""}{_e(said)}</p>')
    parts.extend(f'<p class="note">{_e(n)}</p>' for n in panel.notes)
    parts.append("</section>")
    return "\n".join(parts)


def _runs_table(runs: Sequence[RunData], labels: Sequence[str]) -> str:
    rows = [
        "<table><tr><th>run</th><th>directory</th><th>status</th><th>trained steps</th><th>held-out accuracy</th></tr>"
    ]
    for run, label in zip(runs, labels):
        steps = run.steps
        span = f"{len(steps)} ({steps[0]}..{steps[-1]})" if steps else "0"
        _, acc = run.series("eval/accuracy")
        accuracy = " -> ".join(f"{a:.3f}" for a in (acc[:1] + acc[-1:] if len(acc) > 1 else acc)) or "not logged"
        rows.append(
            f"<tr><td>{_e(label)}</td><td><code>{_e(run.path)}</code></td><td>{_e(run.status_line())}</td>"
            f"<td>{_e(span)}</td><td>{_e(accuracy)}</td></tr>"
        )
    rows.append("</table>")
    return "\n".join(rows)


def _notes(runs: Sequence[RunData], labels: Sequence[str]) -> str:
    items = [f"<li>{_e(label)}: {_e(n)}</li>" for run, label in zip(runs, labels) for n in run.notes]
    if not items:
        return ""
    return '<section id="missing"><h2>What is missing</h2><ul class="missing">' + "".join(items) + "</ul></section>"


def _servers(runs: Sequence[RunData], labels: Sequence[str]) -> str:
    rows = []
    for run, label in zip(runs, labels):
        if not run.servers:
            rows.append(f"<tr><td>{_e(label)}</td><td colspan=3>no server-*.log in the run directory</td></tr>")
        for s in run.servers:
            restarts = max(s.starts - 1, 0)
            rows.append(
                f"<tr><td>{_e(label)}</td><td>{_e(s.name)}</td><td>{s.starts} start(s), {restarts} restart(s)</td>"
                f"<td><code>{_e(s.last_line)}</code></td></tr>"
            )
    return (
        '<section id="server-logs"><h2>Server logs</h2><table><tr><th>run</th><th>log</th><th>starts</th>'
        "<th>last line</th></tr>" + "".join(rows) + "</table></section>"
    )


def _config(runs: Sequence[RunData], labels: Sequence[str]) -> str:
    head = "".join(f"<th>{_e(label)}</th>" for label in labels)
    rows = [f'<section id="config"><h2>Config summary</h2><table><tr><th>key</th>{head}</tr>']
    for key in CONFIG_SUMMARY:
        values = [_fmt(run.config_value(key)) for run in runs]
        cls = ' class="diff"' if len(set(values)) > 1 else ""
        rows.append(
            f"<tr{cls}><td><code>{_e(key)}</code></td>" + "".join(f"<td>{_e(v)}</td>" for v in values) + "</tr>"
        )
    rows.append("</table>")
    for run, label in zip(runs, labels):
        text = run.config_text if run.config_text is not None else "(no config.yaml)"
        rows.append(f"<details><summary>{_e(label)}: config.yaml</summary><pre>{_e(text)}</pre></details>")
    rows.append("</section>")
    return "\n".join(rows)


def _rank_key(run: RunData) -> str | None:
    for key in RANK_KEYS:
        if any(run.value(s, key) is not None for s in run.steps):
            return key
    return None


def _sample_cell(record: dict[str, Any] | None) -> str:
    if record is None:
        return "not recorded"
    uids = [str(u) for u in record.get("uids", [])]
    shown = ", ".join(uids[:MAX_UIDS]) + (f" (+{len(uids) - MAX_UIDS} more)" if len(uids) > MAX_UIDS else "")
    return f"{len(uids)} sample(s): {shown}"


def _best_worst(run: RunData, label: str) -> str:
    key = _rank_key(run)
    title = f"<h3>{_e(label)}</h3>"
    if key is None:
        return title + f'<p class="missing">No step has {_e(" or ".join(RANK_KEYS))}: no ranking of steps.</p>'
    scored = sorted((v, s) for s in run.steps if (v := run.value(s, key)) is not None)
    ranked = [s for _, s in scored]
    # Each end gets at most half of the steps: a short run's steps are listed once.
    k = max(1, min(BEST_WORST, len(ranked) // 2))
    best = list(reversed(ranked[-k:]))
    worst = ranked[:k] if len(ranked) > 1 else []
    rows = [
        f"{title}<p class='note'>Ranked by <code>{_e(key)}</code>; "
        f"<code>areal inspect {_e(run.path)} --step N</code> prints a step's samples.</p>",
        "<table><tr><th></th><th>step</th><th>sampling reward</th><th>trained reward</th><th>staleness mean</th>"
        "<th>version</th><th>trained samples</th></tr>",
    ]
    for which, steps in (("best", best), ("worst", worst)):
        for s in steps:
            row = [run.value(s, k) for k in ("rollout/reward_mean", "reward/mean", "rollout/staleness_mean")]
            record = run.samples.get(s)
            version = record.get("version") if record else run.value(s, "version")
            cells = "".join(f"<td>{_e(_fmt(v))}</td>" for v in row)
            rows.append(
                f"<tr class='{which}'><td>{which}</td><td>{s}</td>{cells}<td>{_e(_fmt(version))}</td>"
                f"<td>{_e(_sample_cell(record))}</td></tr>"
            )
    rows.append("</table>")
    return "\n".join(rows)


def render_report(runs: Sequence[RunData]) -> str:
    """The page for one run, or for two overlaid (a comparison)."""
    if not 1 <= len(runs) <= 2:
        raise ValueError(f"a report shows one run or compares two, got {len(runs)}")
    labels = _labels(runs)
    title = f"areal report: {labels[0]}" if len(runs) == 1 else f"areal report: {labels[0]} vs {labels[1]}"
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = [
        f"<h1>{_e(title)}</h1>",
        f'<p class="note">areal-kernel {_e(__version__)}, {when}.'
        + (
            " The first run is drawn with solid lines and circles, the second dashed with squares."
            if len(runs) > 1
            else ""
        )
        + "</p>",
        _runs_table(runs, labels),
        _notes(runs, labels),
        *(render_panel(p, runs, labels) for p in PANELS),
        _servers(runs, labels),
        _config(runs, labels),
        '<section id="steps"><h2>Best and worst steps</h2>',
        *(_best_worst(run, label) for run, label in zip(runs, labels)),
        "</section>",
    ]
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(b for b in body if b) + "\n</body></html>\n"
    )


def write_report(runs: Sequence[RunData], out: str) -> str:
    """Render ``runs`` and write the page to ``out`` (through a temporary
    file: a half-written page never replaces a previous one). Returns its path."""
    page = render_report(runs)
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, out)
    return out
