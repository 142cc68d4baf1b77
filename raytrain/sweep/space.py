"""A sweep's search space: checked against the spec before any trial, handed to Ray Tune,
and turned into each trial's spec. Pure functions over spec trees, except for the model
and class checks, which import the classes (as preflight does)."""

from __future__ import annotations

import copy
from typing import Any

from raytrain.errors import SpecError
from raytrain.spec import JobSpec
from raytrain.spec.loading import parse_spec, set_path
from raytrain.spec.tune import Distribution, TuneSpec

# Fields whose keys the spec's schema does not know (a class's constructor arguments): a
# value set there is checked against the class's signature, as preflight checks the spec's.
_CLASS_ARGS = ("model.init_args.", "data.init_args.", "optimizer.init_args.",
               "lr_scheduler.init_args.")  # fmt: skip


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
    """Every value a trial can get is one the spec takes: each distribution's bounds (both
    ends of a range, every listed value) set into the spec, the others at the spec's own
    values, pass the spec's validation, and for a class's ``init_args`` its constructor.
    Each problem names ``tune.search_space.FIELD`` and the value."""
    from raytrain.driver import class_check, preflight

    assert spec.tune is not None
    base = base_tree(spec)
    problems: list[str] = []
    for key, dist in spec.tune.search_space.items():
        for value in dist.probes():
            where = f"tune.search_space.{key}: {value!r}"
            try:
                probe = trial_spec(base, {key: value}, spec.name)
            except SpecError as exc:
                problems += [f"{where} is not a value the spec takes: {line}"
                             for line in exc.problems]  # fmt: skip
                break
            if key.startswith(_CLASS_ARGS):
                found = preflight.check_model(probe) + class_check.check_classes(probe)
                if found:
                    problems += [f"{where}: {line}" for line in found]
                    break
    return problems


def param_space(tune: TuneSpec) -> dict[str, Any]:
    """The search space as Ray Tune's samplers."""
    return {key: _sampler(dist) for key, dist in tune.search_space.items()}


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
        return tune.choice(value)
    return tune.grid_search(value)
