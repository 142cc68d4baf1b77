"""Building blocks of the spec's sections: the base section (no unknown keys, no NUL in
any string, no boolean where a number belongs), name patterns, and the location checks
storage fields share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationInfo,
    field_validator,
)

DEFAULT_STORAGE = "runs"
_IMPORT_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
# A run's name and an MLflow experiment's name become folder names (the run's folder, the
# experiment's artifact folder): letters, digits, ``._-`` (and inner spaces in an
# experiment), no path separator, never ``..``.
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_EXPERIMENT = r"^[A-Za-z0-9][A-Za-z0-9 ._-]*$"
# The largest seed Lightning's seed_everything (numpy's RNG) accepts.
MAX_SEED = 2**32 - 1
MAX_SPEC_DEPTH = 64  # nesting of sequences and mappings, through aliases too


class _Section(BaseModel):
    # No NaN or infinity in any float field: a number of workers' CPUs, a clip value or an
    # interval of NaN passes every comparison and fails later, inside the run.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_nul_no_stray_bool(cls, value: Any, info: ValidationInfo) -> Any:
        """Every field: no NUL character in any string (paths and URIs end there in C); and
        no boolean where the field takes none (pydantic would take ``true`` as 1)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _section_type(field.annotation) is not None:
            return value  # a section checks its own fields, naming them
        _refuse_nul(value)
        if field is not None and not _admits_bool(field.annotation):
            _refuse_bool(value)
        return value


def _refuse_nul(value: Any, depth: int = 0) -> None:
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("contains a NUL character (\\x00)")
    elif isinstance(value, Mapping) and depth < MAX_SPEC_DEPTH:
        for key, item in value.items():
            _refuse_nul(key, depth + 1)
            _refuse_nul(item, depth + 1)
    elif isinstance(value, list | tuple) and depth < MAX_SPEC_DEPTH:
        for item in value:
            _refuse_nul(item, depth + 1)


def _admits_bool(annotation: Any) -> bool:
    """Whether a field of this type may hold a boolean: it is ``bool`` or ``Any``
    somewhere."""
    if annotation is bool or annotation is Any:
        return True
    return any(_admits_bool(arg) for arg in getattr(annotation, "__args__", ()))


def _admits_none(annotation: Any) -> bool:
    """Whether a field of this type may hold None."""
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    return any(_admits_none(arg) for arg in getattr(annotation, "__args__", ()))


def _refuse_bool(value: Any, depth: int = 0) -> None:
    if isinstance(value, bool):
        raise ValueError("a boolean (true/false) is not a value of this field")
    if isinstance(value, Mapping) and depth < MAX_SPEC_DEPTH:
        for item in value.values():
            _refuse_bool(item, depth + 1)
    elif isinstance(value, list | tuple) and depth < MAX_SPEC_DEPTH:
        for item in value:
            _refuse_bool(item, depth + 1)


def _check_location(value: str) -> str:
    """A path or URI that can name a store (``storage.location_problem``): no host in a
    ``file://`` URI, no credentials in any URI."""
    from raytrain.storage import location_problem

    problem = location_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


_CREDENTIALS_REFUSED = "credentials do not belong in the spec"


def _no_parent(value: Any) -> Any:
    """A name that becomes a folder name holds no ``..`` (a path out of its parent)."""
    if isinstance(value, str) and ".." in value:
        raise ValueError("must not contain '..' (it becomes a folder name)")
    return value


def _check_endpoint(value: str | None) -> str | None:
    """An endpoint is ``http(s)://host[:port]``, and never carries credentials."""
    if value is None:
        return value
    from urllib.parse import urlparse

    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"expected http(s)://host[:port], got {value!r}")
    if parsed.username or parsed.password:
        raise ValueError(
            f"{_CREDENTIALS_REFUSED}: give them through the provider's standard chain "
            "(environment, profile, instance role)"
        )
    return value.rstrip("/")


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _section_type(arg)
        if found is not None:
            return found
    return None
