"""Where a run's code came from: the git commit of the checkout it ran from.

Both the submission client (which hands the commit to a job, whose copy of the working dir
has no ``.git``) and the MLflow tags read it, so it lives apart from either.
"""

from __future__ import annotations

import os
import subprocess

# Set by ``raytrain submit``: the working dir's commit, which the job's copy (no .git) lacks.
GIT_COMMIT_ENV = "RAYTRAIN_GIT_COMMIT"


def git_commit(folder: str = ".") -> tuple[str, bool] | None:
    """(commit, dirty) of the git checkout ``folder`` is in; None outside one (or no git)."""
    if os.environ.get(GIT_COMMIT_ENV):
        commit, _, dirty = os.environ[GIT_COMMIT_ENV].partition("+")
        return commit, dirty == "dirty"
    try:
        commit = subprocess.run(
            ["git", "-C", folder, "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", folder, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit, bool(status.strip())) if commit else None
