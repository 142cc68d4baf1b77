"""Ray (non-Train) internals raytrain relies on, written for Ray 2.60 (``versions.SUPPORTED``).

- ``upload_matchers``: ``ray._private.runtime_env.packaging`` (``PathSpec``,
  ``get_excludes_from_ignore_files``), ``ray._private.ray_constants``
  (``get_runtime_env_default_excludes``, ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE``) and its
  vendored ``pathspec``'s ``GitWildMatchPattern.escape``: Ray's own
  rules for what a working-dir upload leaves out, so ``submit`` names exactly what Ray drops.
- ``NOISY_LOGGERS``: loggers of Ray internals that print a line per upload or per auth.
- ``arrow_to_numpy``: ``ray.data._internal.arrow_block.ArrowBlockAccessor``'s numpy batch
  format, what ``map_batches(batch_format="numpy")`` hands a function (a fixed-size list
  column as a 2-D array), so ``data.preprocess`` gets the same batch on raytrain's own
  readers as in Ray Data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

NOISY_LOGGERS = {
    "working_dir": "ray._private.runtime_env.working_dir",
    "data_progress": "ray.data._internal.progress",
    "authentication": "ray._private.authentication",
}


@dataclass(frozen=True)
class UploadMatchers:
    """Ray's working-dir upload rules: its default excludes, its gitignore-style matcher,
    the per-folder ignore files it reads, and whether it reads ``.gitignore``."""

    default_excludes: list[str]
    path_spec: Any  # pathspec.PathSpec (Ray's vendored copy)
    excludes_from_ignore_files: Any  # (folder, include_gitignore, logger) -> [matcher]
    reads_gitignore: bool
    escape: Any  # str -> a pattern matching that path literally


def upload_matchers() -> UploadMatchers:
    """Ray's upload rules, as the running Ray applies them."""
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import PathSpec, get_excludes_from_ignore_files
    from ray._private.thirdparty.pathspec.patterns.gitwildmatch import GitWildMatchPattern

    flag = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0")
    return UploadMatchers(
        default_excludes=list(ray_constants.get_runtime_env_default_excludes()),
        path_spec=PathSpec,
        excludes_from_ignore_files=get_excludes_from_ignore_files,
        reads_gitignore=flag != "1",
        escape=GitWildMatchPattern.escape,
    )


def arrow_to_numpy(table: Any) -> dict[str, Any]:
    """An Arrow table as Ray Data's numpy batch: a dict of arrays by column."""
    from ray.data._internal.arrow_block import ArrowBlockAccessor

    return ArrowBlockAccessor(table).to_batch_format("numpy")
