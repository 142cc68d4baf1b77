"""``raytrain report RUN_ID...``: one picture and one table of MLflow runs, to compare them.

The picture (PNG, matplotlib) has three panels over the global step: the losses, the other
metrics (val_acc, ...), and throughput (samples/s), one curve per run and key. The table
lists the params that differ between the runs (every param, for one run) and each run's
final metrics. ``--html`` writes both into one self-contained page (the PNG inlined).

A sweep's parent run (``raytrain tune``) as the one RUN_ID reports its trials: their loss
and sweep-metric curves on one picture, and a row per trial (status, the metric, the
sampled values) sorted best first by the sweep's metric.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from typing import Any

from raytrain.sweep.results import best_first
from raytrain.util.terminal import printable

# Keys that are bookkeeping, not curves: the step counters and checkpoint timing.
_NOT_CURVES = ("epoch", "world_size", "checkpoint_blocked_s", "step")
THROUGHPUT = "samples_per_s"


@dataclass
class Curve:
    run: str  # the run's label: name and short id
    key: str
    steps: list[int]
    values: list[float]


@dataclass
class Report:
    """What the picture plots (panel title → its curves) and the comparison table."""

    panels: dict[str, list[Curve]] = field(default_factory=dict)
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    png: bytes = b""


def _label(run: dict[str, Any]) -> str:
    return f"{run['name']} ({run['run_id'][:8]})"


def _panel(key: str) -> str | None:
    if key.startswith(("_", "system/")) or key in _NOT_CURVES:
        return None
    if key == THROUGHPUT:
        return "throughput (samples/s)"
    return "loss" if "loss" in key else "metrics"


def panels(runs: list[dict[str, Any]]) -> dict[str, list[Curve]]:
    """Each run's metric histories sorted into the picture's panels."""
    out: dict[str, list[Curve]] = {"loss": [], "metrics": [], "throughput (samples/s)": []}
    for run in runs:
        for key, history in sorted(run["histories"].items()):
            title = _panel(key)
            if title is not None and history:
                steps, values = zip(*history, strict=True)
                out[title].append(Curve(_label(run), key, list(steps), list(values)))
    return out


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def table(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Columns (``field``, then one per run) and rows: the params that differ between the
    runs (all of them for one run), then ``metric:`` rows of final values."""
    columns = ["field", *(_label(run) for run in runs)]
    keys = sorted({k for run in runs for k in run["params"]})
    if len(runs) > 1:
        keys = [k for k in keys if len({run["params"].get(k) for run in runs}) > 1]
    rows = [[k, *(run["params"].get(k, "-") for run in runs)] for k in keys]
    metric_keys = sorted({k for run in runs for k in run["metrics"] if not k.startswith("_")})
    rows += [
        [f"metric: {k}", *(_fmt(run["metrics"].get(k, "-")) for run in runs)] for k in metric_keys
    ]
    rows.append(["status", *(run["status"] for run in runs)])
    return columns, rows


def plot(curves: dict[str, list[Curve]]) -> bytes:
    """The panels as one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    # labels are runs' names and metric keys, shown as written: `$\foo$` in a run's name is
    # no mathtext (matplotlib would parse it, and fail)
    with matplotlib.rc_context({"text.parse_math": False}):
        return _figure(plt, curves)


def _figure(plt: Any, curves: dict[str, list[Curve]]) -> bytes:
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    for ax, (title, items) in zip(axes[0], curves.items(), strict=True):
        for curve in items:
            ax.plot(
                curve.steps,
                curve.values,
                marker="." if len(curve.steps) < 30 else None,
                label=f"{curve.key} · {curve.run}",
            )
        ax.set_title(title)
        ax.set_xlabel("global step")
        ax.grid(alpha=0.3)
        if items:
            ax.legend(fontsize="small")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def text_table(columns: list[str], rows: list[list[str]]) -> str:
    """The columns and rows as aligned text, every cell ``printable`` (a run's name, a param,
    a tag is MLflow's data, for a terminal)."""
    cells = [[printable(cell) for cell in row] for row in [columns, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines) + "\n"


def html_page(report: Report) -> str:
    """One page holding the picture (inlined) and the table."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in report.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for row in report.rows
    )
    image = base64.b64encode(report.png).decode()
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>raytrain report</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}</style></head><body>"
        f"<h1>raytrain report</h1><img alt='curves' src='data:image/png;base64,{image}'>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></body></html>\n"
    )


def build_report(run_ids: list[str], tracking_uri: str | None = None) -> Report:
    """The report of ``run_ids`` at ``tracking_uri`` (default: raytrain's default store);
    of a sweep's trials when the one run id is a sweep's parent run."""
    from raytrain.tracking.mlflow_tracker import default_tracking_uri, fetch_runs, sweep_trials

    uri = tracking_uri or default_tracking_uri()
    sweep = sweep_trials(uri, run_ids[0]) if len(run_ids) == 1 else None
    if sweep is not None:
        trials = fetch_runs(uri, sweep["trials"])
        curves = sweep_panels(trials, sweep["metric"])
        columns, rows = sweep_table(trials, sweep["metric"], sweep["mode"])
        return Report(panels=curves, columns=columns, rows=rows, png=plot(curves))
    runs = fetch_runs(uri, run_ids)
    curves = panels(runs)
    columns, rows = table(runs)
    return Report(panels=curves, columns=columns, rows=rows, png=plot(curves))


SAMPLED = "raytrain.sampled."


def sweep_panels(trials: list[dict[str, Any]], metric: str) -> dict[str, list[Curve]]:
    """A sweep's picture: every trial's losses, and its curve of the sweep's metric."""
    curves = panels(trials)
    return {"loss": curves["loss"], metric: [c for c in curves["metrics"] if c.key == metric]}


def sweep_table(
    trials: list[dict[str, Any]], metric: str, mode: str
) -> tuple[list[str], list[list[str]]]:
    """A row per trial, best first by ``metric`` (trials without it last): its name, MLflow
    status, stop reason, the metric, and the values it sampled."""
    sampled = sorted({k for t in trials for k in t["tags"] if k.startswith(SAMPLED)})
    columns = ["trial", "status", metric, *(k.removeprefix(SAMPLED) for k in sampled), "run"]

    def name(trial: dict[str, Any]) -> str:
        return str(trial["tags"].get("raytrain.trial", trial["name"]))

    def order(trial: dict[str, Any]) -> tuple[int, float, str]:
        return best_first(trial["metrics"].get(metric), name(trial), mode)

    rows = []
    for trial in sorted(trials, key=order):
        tags = trial["tags"]
        status = "stopped" if "raytrain.stopped" in tags else trial["status"].lower()
        rows.append(
            [
                name(trial),
                status,
                _fmt(trial["metrics"].get(metric, "-")),
                *(tags.get(k, "-") for k in sampled),
                trial["run_id"][:8],
            ]
        )
    return columns, rows
