"""The sweep's picture for its parent MLflow run: the metric against each sampled field."""

from __future__ import annotations

from raytrain.sweep.results import TrialRow

_COLORS = {"finished": "tab:blue", "stopped": "tab:orange", "error": "tab:red"}


def plot_sweep(rows: list[TrialRow], metric: str, mode: str, path: str) -> list[str]:
    """One panel per sampled field: each trial's last ``metric`` against its value, coloured
    by how the trial ended (a range over decades on a log axis). Writes a PNG to ``path``;
    returns the fields drawn. Every text is drawn as written: a metric or a listed value
    holding ``$`` is no mathtext (a bad one would fail the sweep's end)."""
    import matplotlib

    matplotlib.use("Agg")
    with matplotlib.rc_context({"text.parse_math": False}):
        return _draw(rows, metric, mode, path)


def _draw(rows: list[TrialRow], metric: str, mode: str, path: str) -> list[str]:
    import matplotlib.pyplot as plt

    fields = sorted({key for row in rows for key in row.values})
    fig, axes = plt.subplots(
        1, max(1, len(fields)), figsize=(4.5 * max(1, len(fields)), 3.6), squeeze=False
    )
    for ax, field in zip(axes[0], fields, strict=False):
        for status, color in _COLORS.items():
            points = [
                (row.values[field], row.score(metric))
                for row in rows
                if row.status == status and field in row.values and row.score(metric) is not None
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.scatter(xs, ys, c=color, label=status, s=36)
        numbers = [v for row in rows if isinstance(v := row.values.get(field), int | float)]
        if numbers and min(numbers) > 0 and max(numbers) / min(numbers) >= 10:  # a decade
            ax.set_xscale("log")
        ax.set_xlabel(field)
        ax.set_ylabel(f"{metric} ({mode})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{len(rows)} trials")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fields
