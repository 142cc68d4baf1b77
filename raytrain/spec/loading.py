"""From a path, a mapping or a ``JobSpec`` to a validated ``JobSpec``: overrides applied,
every problem collected into one ``SpecError`` naming field paths."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from raytrain.errors import SpecError
from raytrain.spec.data import DataModuleSpec, DataSpec, MixSourceSpec, SourceSpec
from raytrain.spec.fields import _CREDENTIALS_REFUSED, _section_type
from raytrain.spec.lightning_cli import lightning_cli_tree
from raytrain.spec.model_checkpoint import adopt_model_checkpoint, as_written
from raytrain.spec.sections import JobSpec
from raytrain.spec.yaml_io import MAX_OVERRIDE_PARTS, load_yaml, read_spec_file
from raytrain.util.redaction import redact_tree


def apply_overrides(tree: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``tree`` with each ``a.b.c=value`` applied; values parse as YAML."""
    result = json.loads(json.dumps(tree)) if tree else {}
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            shown = item if len(item) <= 80 else f"{item[:80]}..."
            problems.append(f"override {shown!r}: expected KEY.PATH=VALUE")
            continue
        if key.count(".") >= MAX_OVERRIDE_PARTS:
            problems.append(
                f"override {key[:60]}...: {key.count('.') + 1} dotted parts, more "
                f"than the limit of {MAX_OVERRIDE_PARTS}"
            )
            continue
        try:
            value = load_yaml(raw, f"{key}: override value") if raw else ""
        except SpecError as exc:
            problems.extend(exc.problems)
            continue
        problem = set_path(result, key, value)
        if problem:
            problems.append(problem)
    if problems:
        raise SpecError(problems)
    return result


def set_path(tree: dict[str, Any], key: str, value: Any) -> str | None:
    """Set the dotted ``key`` of ``tree`` (in place) to ``value``, making the sections on
    the way; the problem, naming ``key``, when a part on the way is not a section."""
    node = tree
    *parents, leaf = key.split(".")
    for depth, part in enumerate(parents):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parents[: depth + 1])
            return f"{key}: cannot set inside {where}, which is not a section"
        node = child
    node[leaf] = value
    return None


def _format_errors(error: ValidationError, model: type[BaseModel]) -> list[str]:
    lines = []
    for item in error.errors():
        # a discriminated union's tag (`data`'s kind) is not a field the user wrote
        loc = [part for part in item["loc"] if part not in UNION_TAGS]
        if item["type"] in ("unknown_argument", "field_problem"):  # a section's own check
            loc.append(item["ctx"]["field"])
        path = ".".join(str(part) for part in loc) or "(spec)"
        if item["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, item["loc"][:-1])
            hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
            lines.append(f"{path}: unknown field{hint}")
        elif item["type"] == "missing":
            lines.append(f"{path}: required field is missing")
        else:
            got = item.get("input")
            # a check's own message, without pydantic's "Value error, " before it
            msg = item["msg"].removeprefix("Value error, ")
            # a value refused for holding credentials is not echoed into a log
            secret = _CREDENTIALS_REFUSED in msg
            # a section's own check (a model validator) gets the section, not one value
            shown = "" if secret or isinstance(got, dict | list | BaseModel) else f", got {got!r}"
            if shown and repr(got) in msg:  # the check's own message shows it
                shown = ""
            lines.append(f"{path}: {msg}{shown}")
    return lines


def validation_problems(error: ValidationError) -> list[str]:
    """The problem lines of a ``JobSpec``'s ``ValidationError``, made by parsing or by
    assigning a section (a sweep checks each value of a field so)."""
    return _format_errors(error, JobSpec)


# The tags of discriminated unions (``data``: files or a DataModule), and their sections.
UNION_TAGS: dict[str, type[BaseModel]] = {
    "files": DataSpec,
    "module": DataModuleSpec,
    "source": SourceSpec,
    "mix": MixSourceSpec,
}


def _allowed_keys(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """The field names of the section at ``loc``, for 'unknown field' hints."""
    current: Any = model
    for part in loc:
        if part in UNION_TAGS:
            current = UNION_TAGS[part]
            continue
        if isinstance(part, int):  # an item of a list of sections (a mix's sources)
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = _section_type(field.annotation)
        if current is None:
            return []
    return sorted(getattr(current, "model_fields", {}))


def parse_spec(tree: Any, source: str = "spec") -> JobSpec:
    """Validate a spec given as a mapping (e.g. from a pipeline) into a ``JobSpec``."""
    if not isinstance(tree, dict):
        raise SpecError(f"{source}: expected a mapping of sections, got {type(tree).__name__}")
    tree, problems = lightning_cli_tree(tree)
    adopted = adopt_model_checkpoint(tree)
    problems += adopted.problems
    for note in adopted.notes:
        print(f"raytrain: {note}", file=sys.stderr)
    try:
        spec = JobSpec.model_validate(adopted.tree)
    except ValidationError as exc:
        found = [as_written(p, adopted.taken_from) for p in _format_errors(exc, JobSpec)]
        raise SpecError(problems + found) from None
    if problems:
        raise SpecError(problems)
    spec._callbacks_taken_from = adopted.taken_from
    return spec


def load_spec(
    spec: str | os.PathLike[str] | Mapping[str, Any] | JobSpec,
    overrides: Iterable[str] = (),
) -> JobSpec:
    """Load a spec from a YAML path, a mapping or a ``JobSpec``, apply overrides, validate."""
    overrides = list(overrides)
    if isinstance(spec, JobSpec):
        if not overrides:
            return spec
        tree, source = spec.model_dump(mode="json"), "spec"
    elif isinstance(spec, Mapping):
        tree, source = dict(spec), "spec"
    else:
        source = os.fspath(spec)
        tree = read_spec_file(source)
        named = any(item.partition("=")[0] == "name" for item in overrides)
        if isinstance(tree, dict) and "name" not in tree and not named:
            # as LightningCLI configs have no name: the file's, said once
            tree["name"] = Path(source).stem
            print(
                f"raytrain: {source} has no name: the run is named {tree['name']!r}",
                file=sys.stderr,
            )
    return parse_spec(apply_overrides(tree, overrides), source)


def dump_spec(spec: JobSpec) -> str:
    """The resolved spec as YAML, defaults filled in (no ``tune`` key unless it sweeps),
    credentials masked as everywhere raytrain shows a spec (``redaction.redact_tree``):
    ``raytrain validate`` printed a tracking URI's password and a tag's token as written."""
    exclude = {"tune"} if spec.tune is None else None
    tree = redact_tree(spec.model_dump(mode="json", exclude=exclude))
    return yaml.safe_dump(tree, sort_keys=False)
