"""A sweep's search space: checked against the spec before any trial, handed to Ray Tune,
and turned into each trial's spec. Pure functions over spec trees, except for the model
and class checks, which import the classes (as preflight does)."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import ValidationError

from raytrain.errors import SpecError
from raytrain.spec import JobSpec
from raytrain.spec.lightning_cli import OWNED_TRAINER_ARGUMENTS
from raytrain.spec.loading import parse_spec, set_path, validation_problems
from raytrain.spec.tune import MAX_RUNGS, Distribution, TuneSpec

# Fields whose keys the spec's schema does not know (a class's constructor arguments): the
# names set there are bound to the class's signature, as preflight binds the spec's. The
# names, not the values: once per field.
_CLASS_SECTIONS = ("model", "data", "optimizer", "lr_scheduler")
_CLASS_ARGS = tuple(f"{section}.init_args." for section in _CLASS_SECTIONS)
# Fields that name a class or all its arguments: checked against the class for each value.
_CLASS_NAMING = frozenset(
    f"{section}{part}" for section in _CLASS_SECTIONS for part in ("", ".class_path", ".init_args")
)


def base_tree(spec: JobSpec) -> dict[str, Any]:
    """The spec every trial starts from: resolved (defaults filled in), without ``tune``."""
    return spec.model_dump(mode="json", exclude={"tune"})


def trial_spec(base: dict[str, Any], values: dict[str, Any], name: str) -> JobSpec:
    """``base`` with each dotted field of ``values`` set, named ``name``; validated."""
    tree = copy.deepcopy(base)
    for key, value in values.items():
        problem = set_path(tree, key, value)
        if problem:
            raise SpecError(f"tune.search_space.{problem}")
    tree["name"] = name
    return parse_spec(tree, f"trial {name}")


def check_space(spec: JobSpec) -> list[str]:
    """Every value a trial can get is one the spec takes, and the scheduler is one Ray Tune
    runs (``schedule_problems``). Each distinct value of a distribution (both ends of a
    range, every listed value) is set into the spec, the other fields at the spec's own
    values, and validated: the first value of each type by parsing the whole spec (and,
    for a class's ``init_args``, binding them to its constructor), the rest by validating
    the one top-level section that holds the field (``_section_problems``), microseconds
    each: the check grows with the values, not with the values times a spec parse. Each
    problem names ``tune.search_space.FIELD`` and the value; one per field."""
    assert spec.tune is not None
    base = base_tree(spec)
    problems = schedule_problems(spec)
    for key, dist in spec.tune.search_space.items():
        problems += _field_problems(spec, base, key, dist.probes())
    return problems


def _field_problems(spec: JobSpec, base: dict[str, Any], key: str, values: list[Any]) -> list[str]:
    """The first problem among ``values`` of the field ``key`` (see ``check_space``)."""
    checked_types: set[type] = set()
    names_a_class = key in _CLASS_NAMING
    for value in _distinct(values):
        where = f"tune.search_space.{key}: {value!r}"
        whole = names_a_class or type(value) not in checked_types
        found = None if whole else _section_problems(spec, base, key, value)
        if found is None:  # the whole spec, parsed
            try:
                probe = trial_spec(base, {key: value}, spec.name)
            except SpecError as exc:
                found = exc.problems
            else:
                if names_a_class or (key.startswith(_CLASS_ARGS) and not checked_types):
                    classes = _class_problems(probe)
                    if classes:
                        return [f"{where}: {line}" for line in classes]
            checked_types.add(type(value))
        if found:
            return [f"{where} is not a value the spec takes: {line}" for line in found]
    return []


def _distinct(values: list[Any]) -> list[Any]:
    """``values`` without repeats (``1`` and ``True`` are different values)."""
    seen: dict[tuple[str, str], Any] = {}
    for value in values:
        seen.setdefault((type(value).__name__, repr(value)), value)
    return list(seen.values())


def _class_problems(probe: JobSpec) -> list[str]:
    from raytrain.driver import class_check, preflight

    return preflight.check_model(probe) + class_check.check_classes(probe)


def _section_problems(
    spec: JobSpec, base: dict[str, Any], key: str, value: Any
) -> list[str] | None:
    """The problems of the spec with ``key`` set to ``value``, from validating only the
    top-level section that holds it: assigned to a copy of the spec, the section is
    validated whole (its fields, its own checks, its subsections) and so are the spec's
    checks across sections (pydantic's ``validate_assignment``). None when the key is no
    field of a section, or one that LightningCLI's mapping moves (``lightning_cli``): the
    whole spec is parsed then."""
    top = key.split(".", 1)[0]
    if top not in type(spec).model_fields or top in ("name", "tune") or _cli_mapped(key):
        return None
    tree = {top: copy.deepcopy(base.get(top))}
    problem = set_path(tree, key, value)
    if problem:
        return [f"tune.search_space.{problem}"]
    try:
        setattr(spec.model_copy(), top, tree[top])
    except ValidationError as exc:
        return validation_problems(exc)
    return []


def _cli_mapped(key: str) -> bool:
    """Whether ``key`` is ``trainer`` or a Trainer argument LightningCLI's mapping moves
    or refuses before validation."""
    parts = key.split(".")
    if parts[0] != "trainer":
        return False
    return len(parts) == 1 or parts[1] == "accelerator" or parts[1] in OWNED_TRAINER_ARGUMENTS


def schedule_problems(spec: JobSpec) -> list[str]:
    """ASHA's settings as Ray Tune takes them, checked before Ray: ``grace_period`` at most
    ``max_t``, ``max_t`` at most the trainer's limit in ``time_attr``'s unit (the largest a
    trial can get, when the search samples it), and at most ``MAX_RUNGS`` rungs between."""
    assert spec.tune is not None
    chosen = spec.tune.scheduler
    if chosen.name != "asha":
        return []
    field = chosen.limit_field()
    limit = spec.trainer.max_epochs if chosen.time_attr == "epoch" else spec.trainer.max_steps
    max_t = chosen.resolved_max_t(limit)
    shown = f"tune.scheduler.max_t ({max_t})" if chosen.max_t else f"max_t ({max_t}, {field})"
    if chosen.grace_period > max_t:
        return [
            f"tune.scheduler.grace_period: {chosen.grace_period} is above {shown}: "
            "ASHA's first rung would come after every trial's end (Ray Tune refuses "
            "it)"
        ]
    sampled = spec.tune.search_space.get(field)
    limits = [limit, *(sampled.probes() if sampled else [])]
    ends = [n for n in limits if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    if chosen.max_t is not None and ends and chosen.max_t > max(ends):
        return [
            f"tune.scheduler.max_t: {chosen.max_t} is above {field} ({max(ends)}): no "
            "trial trains that long, so ASHA's last rungs are never reached"
        ]
    rungs = chosen.rungs(max_t)
    if rungs > MAX_RUNGS:
        return [
            f"tune.scheduler.reduction_factor: {chosen.reduction_factor} makes {rungs} "
            f"rungs from grace_period {chosen.grace_period} to {shown}, more than the "
            f"limit of {MAX_RUNGS} (at 1.5, 10,000 trials are down to one by rung "
            "23)"
        ]
    return []


def listed_values(tune: TuneSpec) -> dict[str, list[Any]]:
    """Each ``choice`` and ``grid`` field's values, in order: Tune draws an index into
    them (``param_space``), and the trial looks its value up (``values_of``)."""
    return {
        key: list(getattr(dist, dist.kind))
        for key, dist in tune.search_space.items()
        if dist.kind in ("choice", "grid")
    }


def param_space(tune: TuneSpec) -> dict[str, Any]:
    """The search space as Ray Tune's samplers. A listed field (``choice``, ``grid``) is
    drawn as an index into its values: Tune's files (trial configs, its experiment and
    searcher state, its folder names) then hold numbers only, never a listed value (a URI
    with a signature, a token); ``values_of`` turns a trial's config into its values."""
    return {key: _sampler(dist) for key, dist in tune.search_space.items()}


def values_of(config: dict[str, Any], listed: dict[str, list[Any]]) -> dict[str, Any]:
    """A trial's values from its Tune config: listed fields' indices looked up."""
    return {key: listed[key][int(v)] if key in listed else v for key, v in config.items()}


def _sampler(dist: Distribution) -> Any:
    from ray import tune

    value = getattr(dist, dist.kind)
    if dist.kind == "uniform":
        return tune.uniform(*value)
    if dist.kind == "loguniform":
        return tune.loguniform(*value)
    if dist.kind == "randint":
        return tune.randint(*value)
    if dist.kind == "choice":
        return tune.choice(list(range(len(value))))
    return tune.grid_search(list(range(len(value))))
