"""Building blocks of the spec's sections: the base section (no unknown keys, no NUL in
any string, no boolean where a number belongs), name patterns, and the location checks
storage fields share."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

DEFAULT_STORAGE = "runs"
_IMPORT_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
# The one rule for a name a user gives that becomes a folder or file name, a metric, param
# or tag key, or a label (``check_name``): letters, digits and ``._-``, starting with a
# letter or digit (so never ``.``, ``..`` or a hidden file), no ``..`` anywhere, no path
# separator (a tag's key: parts of that rule joined by ``/``). MLflow accepts it as a key on
# every platform (its own check: ``[/\w.\- :]*``, and no path that normalizes to another,
# ``mlflow.utils.validation``) and Prometheus as a label value. Names that are only shown
# (an experiment's, a registered model's) may hold inner spaces too.
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_EXPERIMENT = r"^[A-Za-z0-9][A-Za-z0-9 ._-]*$"
MAX_NAME_CHARS = 128
MAX_KEY_CHARS = 250  # MLflow's longest metric, param or tag key
# The largest seed Lightning's seed_everything (numpy's RNG) accepts.
MAX_SEED = 2**32 - 1
MAX_SPEC_DEPTH = 64  # nesting of sequences and mappings, through aliases too
# Batches one optimizer step accumulates, given (trainer.accumulate_grad_batches) or made
# up for fewer workers (scaling.keep_global_batch): past this a step is a typo's length.
MAX_ACCUMULATION = 1024


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


def _refuse_nul(value: object, depth: int = 0) -> None:
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


def _admits_bool(annotation: object) -> bool:
    """Whether a field of this type may hold a boolean: it is ``bool`` or ``Any``
    somewhere."""
    if annotation is bool or annotation is Any:
        return True
    return any(_admits_bool(arg) for arg in getattr(annotation, "__args__", ()))


def _admits_none(annotation: object) -> bool:
    """Whether a field of this type may hold None."""
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    return any(_admits_none(arg) for arg in getattr(annotation, "__args__", ()))


def _refuse_bool(value: object, depth: int = 0) -> None:
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
    from raytrain.storage.locations import location_problem

    problem = location_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


_CREDENTIALS_REFUSED = "credentials do not belong in the spec"


def field_problem(field: str, message: str) -> PydanticCustomError:
    """The error a section's check across its fields raises about one of them: listed
    under ``field``'s path (dotted, below the section), not the section's
    (``loading._format_errors``)."""
    return PydanticCustomError("field_problem", "{message}", {"field": field, "message": message})


def check_name(value: str, *, spaces: bool = False, key: bool = False) -> str:
    """``value`` if it follows the rule for names (``_NAME``; ``spaces``: inner spaces too;
    ``key``: parts joined by ``/``, up to ``MAX_KEY_CHARS``), else a ``ValueError`` saying
    the rule. Every name a user gives that ends up a file name, a key or a label is checked
    here, before Ray starts."""
    pattern = _EXPERIMENT if spaces else _NAME
    parts = value.split("/") if key else [value]
    limit = MAX_KEY_CHARS if key else MAX_NAME_CHARS
    shown = repr(value) if len(value) <= 80 else f"{value[:80]!r}..."
    rule = (
        f"letters, digits, '._-'{', inner spaces' if spaces else ''}, starting with a "
        f"letter or digit, no '..'{'; parts joined by /' if key else ', no /'}"
    )
    if len(value) > limit:
        raise ValueError(f"{shown}: longer than {limit} characters")
    if not all(re.fullmatch(pattern, part) for part in parts) or ".." in value:
        raise ValueError(f"{shown} cannot name files, metrics or labels: {rule}")
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


def _section_type(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _section_type(arg)
        if found is not None:
            return found
    return None
