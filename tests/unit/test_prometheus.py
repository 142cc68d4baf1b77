"""The run's Ray metrics, set from its events with a recording gauge (no Ray), and the
Grafana dashboard that charts them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from raytrain.contract import HangReport, TimelineWindow
from raytrain.tracking.prometheus import GAUGES, RayMetrics
from tests.unit.events import report

DASHBOARD = Path(__file__).parents[2] / "cluster" / "grafana" / "raytrain.json"


class Recorder:
    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...]):
        self.name, self.description, self.tag_keys = name, description, tag_keys
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def set(self, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tag_keys), (self.name, tags)  # Ray wants every key
        self.values[tuple(sorted(tags.items()))] = value


def _metrics() -> tuple[RayMetrics, dict[str, Recorder]]:
    made: dict[str, Recorder] = {}

    def make(name: str, description: str, keys: tuple[str, ...]) -> Recorder:
        made[name] = Recorder(name, description, keys)
        return made[name]

    return RayMetrics("digits", make=make), made


def _values(gauge: Recorder) -> dict[tuple[str, ...], float]:
    return {tuple(v for _, v in key): value for key, value in gauge.values.items()}


def test_rank_0s_reports_timelines_and_hangs_set_the_gauges() -> None:
    metrics, made = _metrics()
    assert set(made) == set(GAUGES) and all(g.description for g in made.values())
    assert all(re.fullmatch(r"raytrain_[a-z_]+", name) for name in made)
    metrics.on_report(
        report(
            10,
            train_loss=0.5,
            samples_per_s=900.0,
            started=0,
            **{"system/cpu_percent": 80.0, "lr-Adam": 1e-3},
        )
    )
    metrics.on_report(report(23, kind="epoch", val_acc=0.93, checkpoint_blocked_s=0.2))
    metrics.on_report(report(24, epoch=1, started=20))
    assert _values(made["raytrain_step"]) == {("0", "digits"): 24.0}
    assert _values(made["raytrain_epoch"]) == {("0", "digits"): 1.0}
    assert _values(made["raytrain_train_loss"]) == {("0", "digits"): 0.5}
    assert _values(made["raytrain_samples_per_second"]) == {("0", "digits"): 900.0}
    assert _values(made["raytrain_checkpoint_stall_seconds"]) == {("0", "digits"): 0.2}
    assert _values(made["raytrain_restarts"]) == {("0", "digits"): 1.0}  # two groups
    # other numbers by name; no system samples or the world size
    assert _values(made["raytrain_metric"]) == {
        ("lr-Adam", "0", "digits"): 1e-3,
        ("val_acc", "0", "digits"): 0.93,
    }

    metrics.on_timeline(
        TimelineWindow(
            rank=1,
            node="n",
            step=10,
            world_size=2,
            parts={"busy": [0.05, 0.06, 0.055], "comm_wait": [0.01, 0.02, 0.012]},
        )
    )
    parts = _values(made["raytrain_step_part_seconds"])
    assert parts[("busy", "1", "digits", "p90")] == 0.06 and len(parts) == 6
    hang = HangReport(1, 2, "n", 9, 10, "training", 70.0, 60.0, None, "t", "s", 0.0)
    for _ in range(2):
        metrics.on_hang(hang)
    assert _values(made["raytrain_hangs"]) == {("1", "digits"): 2.0}


def _queried(dashboard: dict[str, Any]) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return {name for expr in exprs for name in re.findall(r"\bray_[a-z_]+\b", expr)}


def test_the_dashboard_charts_the_gauges_raytrain_sets() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert "label_values(ray_raytrain_step, run)" in variables["run"]["definition"]
    ours = {name for name in _queried(dashboard) if name.startswith("ray_raytrain_")}
    # Ray prefixes every ray.util.metrics series with ray_; each gauge is charted
    assert ours == {f"ray_{name}" for name in GAUGES}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["targets"] and panel["gridPos"]["w"] <= 24
        for target in panel["targets"]:
            raytrain_series = "ray_raytrain_" in target["expr"]
            assert not raytrain_series or 'run=~"$run"' in target["expr"], target
