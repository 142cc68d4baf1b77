"""Where planted secrets ended up: every file (and file name) under a run's or a sweep's
folders, and every MLflow value of the runs: params, tags, metric keys, run names, and the
artifacts' contents."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def files_holding(secrets: Iterable[str], roots: Iterable[Path]) -> list[str]:
    """``path: secret`` for each file under ``roots`` whose name or bytes hold a secret."""
    secrets = list(secrets)
    found = []
    for root in roots:
        for path in [root, *root.rglob("*")]:
            hits = [s for s in secrets if s in str(path.relative_to(root.parent))]
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                hits += [s for s in secrets if s.encode() in data]
            found += [f"{path}: {s}" for s in hits]
    return found


def mlflow_holding(secrets: Iterable[str], tracking_uri: str, work: Path) -> list[str]:
    """``run: where: secret`` for each value of every run in the store that holds a
    secret; artifacts are downloaded under ``work`` and read whole."""
    from mlflow.tracking import MlflowClient

    secrets = list(secrets)
    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = []
    for run in client.search_runs(experiments, max_results=1000):
        run_id = run.info.run_id
        values = {
            "name": run.info.run_name or "",
            **{f"param {k}": f"{k}={v}" for k, v in run.data.params.items()},
            **{f"tag {k}": f"{k}={v}" for k, v in run.data.tags.items()},
            **{f"metric {k}": k for k in run.data.metrics},
        }
        found += [
            f"{run_id}: {where}: {s}"
            for where, text in values.items()
            for s in secrets
            if s in text
        ]
        local = Path(client.download_artifacts(run_id, "", str(work / run_id)))
        found += [f"{run_id}: artifact {hit}" for hit in files_holding(secrets, [local])]
    return found
