"""The versions of Ray, Lightning, MLflow and torch that ``raytrain._compat`` was written for.

Every entry of ``_compat`` relies on internals of these releases. On other releases those
internals may be gone, or worse, still there with other meanings, so raytrain refuses to
start outside the ranges (``check_supported``) instead of running with other semantics.
The ranges are also ``pyproject.toml``'s; ``tests/unit/test_compat.py`` checks both agree.
"""

from __future__ import annotations

from importlib import metadata

from raytrain.errors import SpecError

# distribution -> (lowest supported, first unsupported): major.minor[.patch] prefixes
SUPPORTED: dict[str, tuple[str, str]] = {
    "ray": ("2.60", "2.61"),
    "lightning": ("2.6", "2.7"),
    "mlflow": ("3.0", "4.0"),
    "torch": ("2.4", "3.0"),
}


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of ``version`` (``2.60.1rc1`` -> (2, 60, 1)); stops at the first
    part that is not a number."""
    out: list[int] = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(out)


def unsupported(installed: dict[str, str | None]) -> list[str]:
    """One line for each distribution in ``installed`` (name -> version, None: missing)
    outside ``SUPPORTED``."""
    problems = []
    for name, version in installed.items():
        low, high = SUPPORTED[name]
        if version is None:
            problems.append(f"{name} is not installed; raytrain needs {name}>={low},<{high}")
        elif not _release(low) <= _release(version) < _release(high):
            problems.append(
                f"{name} {version} is installed; raytrain {_own_version()} supports "
                f"{name}>={low},<{high} (it relies on that release's internals: see "
                "raytrain/_compat)"
            )
    return problems


def installed_versions() -> dict[str, str | None]:
    """The installed version of each supported distribution (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in SUPPORTED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def check_supported() -> None:
    """Raise ``SpecError`` (exit 2) naming every installed version raytrain does not
    support. Reads package metadata only: nothing is imported."""
    problems = unsupported(installed_versions())
    if problems:
        raise SpecError(problems)


def _own_version() -> str:
    try:
        return metadata.version("raytrain")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree on sys.path
        return "(source)"
