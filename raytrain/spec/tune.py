"""The ``tune`` section: a hyperparameter sweep over the spec's own fields (``raytrain tune``).

A sweep is the spec plus this section, in the same file, rather than a sweep file beside
it: one file is what ``raytrain tune`` reads, what ``raytrain submit`` uploads, and what a
reader needs to know what a trial is. Each key of ``search_space`` is a dotted field path of
the spec (``model.init_args.lr``), so every trial is the spec with those fields set; the
sweep checks each distribution's bounds against the spec's own validation before any trial
starts (``raytrain.sweep.space``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raytrain.spec.fields import MAX_SEED, MAX_SPEC_DEPTH, _Section

DISTRIBUTIONS = ("uniform", "loguniform", "randint", "choice", "grid")
# The most trials a sweep runs: num_samples times every combination of the grids. It also
# bounds the values a search space lists (a value no trial can get is not searched) and so
# what checking them costs.
MAX_TRIALS = 10_000
MAX_FIELDS = 100  # fields in one search space
# Ray draws randint with numpy's 64-bit integers.
_INT64 = (-(2**63), 2**63 - 1)
# ASHA's reduction factor: below this, a rung keeps more than 2/3 of the trials it sees, and
# the rungs from grace_period to max_t (log(max_t / grace_period) / log(factor) + 1 of them,
# each a table Ray builds up front) multiply: 1.0000001 made 46 million.
MIN_REDUCTION_FACTOR = 1.5
# The most rungs ASHA may build: at factor 1.5, 10,000 trials are down to one by rung 23,
# so rungs past this stop nothing.
MAX_RUNGS = 32

# The fields every trial sets itself (``sweep.trial.trial_values``), and why: a value
# sampled for one of them would be overridden, yet written into best.yaml as if it counted.
RESERVED_FIELDS = {
    "name": "each trial's name is the sweep's, numbered",
    "tune": "a trial runs one spec; the sweep is the spec's tune section",
    "checkpoint": "each trial keeps its checkpoints in the sweep's folder, ranked by "
    "tune.metric: they are how the sweep resumes it, not a hyperparameter",
    "tracking.mlflow.tracking_uri": "every trial records to the sweep's MLflow store",
    "tracking.mlflow.experiment": "every trial's run is nested in the sweep's experiment",
    "tracking.mlflow.tags": "each trial's tags name its sweep, its parent run and its "
    "sampled values",
}


def reserved_problem(key: str) -> str | None:
    """Why a sweep may not sample the dotted field ``key``: it is, holds or lies inside a
    field every trial sets (``RESERVED_FIELDS``); None when it may."""
    for field, why in RESERVED_FIELDS.items():
        if key == field or key.startswith(f"{field}.") or field.startswith(f"{key}."):
            held = "" if key == field or key.startswith(f"{field}.") else f" (it holds {field})"
            return f"{key!r}: a sweep may not sample it{held}: {why}"
    return None


def _non_finite(value: Any, depth: int = 0) -> float | None:
    """The first NaN or infinity in ``value`` (a number, or inside lists and mappings)."""
    if isinstance(value, float):
        return None if math.isfinite(value) else value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    if depth < MAX_SPEC_DEPTH:
        for item in items:
            found = _non_finite(item, depth + 1)
            if found is not None:
                return found
    return None


class Distribution(_Section):
    """One field's values: exactly one of the keys, as Ray Tune's samplers name them."""

    uniform: tuple[float, float] | None = Field(
        default=None, description="[low, high]: a float drawn uniformly."
    )
    loguniform: tuple[float, float] | None = Field(
        default=None, description="[low, high], 0 < low: a float drawn uniformly in log space."
    )
    randint: tuple[int, int] | None = Field(
        default=None, description="[low, high]: an integer low <= n < high (Ray's)."
    )
    choice: list[Any] | None = Field(
        default=None, min_length=1, description="Values, one drawn per trial."
    )
    grid: list[Any] | None = Field(
        default=None,
        min_length=1,
        description="Values, each tried (every combination of the grids, `num_samples` times).",
    )

    @model_validator(mode="after")
    def _one_kind_with_sane_bounds(self) -> Distribution:
        given = [kind for kind in DISTRIBUTIONS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(
                f"expected exactly one of {', '.join(DISTRIBUTIONS)}, got "
                f"{', '.join(given) or 'none'}"
            )
        kind = given[0]
        if kind in ("uniform", "loguniform", "randint"):
            _check_range(kind, *getattr(self, kind))
        else:
            _check_listed(kind, getattr(self, kind))
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in DISTRIBUTIONS if getattr(self, kind) is not None)

    def probes(self) -> list[Any]:
        """The values that bound what a trial can get: each end of a range (``randint``'s
        largest is high - 1), every listed value."""
        value = getattr(self, self.kind)
        if self.kind == "randint":
            return [value[0], value[1] - 1]
        return list(value)


def _check_range(kind: str, low: float, high: float) -> None:
    """A range Ray Tune can draw from: low below high; for ``uniform`` a width that is a
    finite float (Tune draws low + u * (high - low): [-1e308, 1e308] overflows); for
    ``loguniform`` low above 0; for ``randint`` bounds numpy's 64-bit integers hold."""
    if not low < high:
        raise ValueError(f"{kind}: low must be below high, got [{low}, {high}]")
    if kind == "uniform" and not math.isfinite(high - low):
        raise ValueError(
            f"uniform: [{low}, {high}] is wider than a float holds (high - low "
            "overflows, and Ray Tune draws low + u * (high - low))"
        )
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"loguniform: low must be above 0, got {low}")
    if kind == "randint" and not (_INT64[0] <= low and high <= _INT64[1]):
        raise ValueError(
            f"randint: [{low}, {high}] is outside the 64-bit integers Ray Tune draws from"
        )


def _check_listed(kind: str, values: list[Any]) -> None:
    """Listed values a trial can get: at most ``MAX_TRIALS`` of them (no sweep runs more
    trials), and no NaN or infinity among them or inside them (a NaN learning rate passes
    every comparison and trains nothing)."""
    if len(values) > MAX_TRIALS:
        raise ValueError(
            f"{kind}: {len(values):,} values, more than the limit of "
            f"{MAX_TRIALS:,} (the most trials a sweep runs)"
        )
    for value in values:
        bad = _non_finite(value)
        if bad is not None:
            held = "" if bad is value else f" holds {bad}, which"
            raise ValueError(f"{kind}: {value!r}{held} is not a finite number")


class TrialSchedulerSpec(_Section):
    """How trials are stopped: all run to the end (``fifo``), or ASHA stops the poorer
    ones at each rung (``asha``), freeing their workers."""

    name: Literal["fifo", "asha"] = Field(default="fifo", description="`fifo` or `asha`.")
    time_attr: Literal["epoch", "step"] = Field(
        default="epoch",
        description="What ASHA's `grace_period` and `max_t` count: epochs or optimizer steps.",
    )
    grace_period: int = Field(
        default=1, ge=1, description="ASHA: the least a trial trains before it can be stopped."
    )
    reduction_factor: float = Field(
        default=4,
        description="ASHA: 1/reduction_factor of trials go on at each rung; at least 1.5.",
    )
    max_t: int | None = Field(
        default=None,
        ge=1,
        description="ASHA: the most a trial trains; default: trainer.max_epochs (or max_steps).",
    )

    def limit_field(self) -> str:
        """The trainer's limit in ``time_attr``'s unit: what ``max_t`` defaults to."""
        return "trainer.max_epochs" if self.time_attr == "epoch" else "trainer.max_steps"

    def resolved_max_t(self, limit: int | None) -> int:
        """``max_t``, or the trainer's limit (``limit_field``'s value) when it sets one,
        else 100."""
        return self.max_t or (limit if limit and limit > 0 else 100)

    def rungs(self, max_t: int) -> int:
        """How many rungs Ray's ASHA builds from ``grace_period`` to ``max_t`` (its
        ``_Bracket``: int(log(max_t / grace_period) / log(reduction_factor)) + 1)."""
        return int(math.log(max_t / self.grace_period) / math.log(self.reduction_factor)) + 1

    @field_validator("reduction_factor")
    @classmethod
    def _rungs_that_reduce(cls, value: float) -> float:
        if not value >= MIN_REDUCTION_FACTOR:
            raise ValueError(
                f"{value} is below {MIN_REDUCTION_FACTOR}: each rung would keep "
                f"more than 1/{MIN_REDUCTION_FACTOR} of the trials it sees, and "
                "ASHA builds log(max_t / grace_period) / log(reduction_factor) "
                "rungs up front (1.0000001 makes millions)"
            )
        return value

    @model_validator(mode="after")
    def _asha_fields_only_for_asha(self) -> TrialSchedulerSpec:
        if self.name == "fifo":
            asha = {"time_attr", "grace_period", "reduction_factor", "max_t"}
            given = sorted(asha & self.model_fields_set)
            if given:
                raise ValueError(f"{', '.join(given)}: only for name: asha")
        if self.max_t is not None and self.grace_period > self.max_t:
            raise ValueError(
                f"grace_period ({self.grace_period}) is above max_t "
                f"({self.max_t}): ASHA's first rung would come after every "
                "trial's end (Ray Tune refuses it)"
            )
        return self


class TuneSpec(_Section):
    """A sweep: trials of the spec with the fields of ``search_space`` drawn or gridded."""

    search_space: dict[str, Distribution] = Field(
        min_length=1,
        max_length=MAX_FIELDS,
        description="Dotted spec fields and their values, e.g. `model.init_args.lr: "
        "{loguniform: [1e-4, 1e-1]}`, `data.batch_size: {choice: [32, 64]}`.",
    )
    metric: str = Field(
        min_length=1, description="The reported metric trials are compared by (`val_acc`)."
    )
    mode: Literal["min", "max"] = Field(description="Whether a lower or higher metric is better.")
    num_samples: int = Field(
        default=1,
        ge=1,
        le=MAX_TRIALS,
        description="Trials drawn (with grids: times each grid); num_samples times the "
        "grids' combinations is at most 10,000.",
    )
    max_concurrent_trials: int | None = Field(
        default=None,
        ge=1,
        description="The most trials at once; default: as many as the cluster holds.",
    )
    seed: int = Field(
        default=0, ge=0, le=MAX_SEED, description="The search's seed: the same trials each time."
    )
    scheduler: TrialSchedulerSpec = Field(
        default_factory=TrialSchedulerSpec,
        description="When trials stop: `fifo` (each to its end) or `asha` (early stopping).",
    )
    search_alg: Literal["random", "optuna"] = Field(
        default="random",
        description="`random` (grid for `grid` fields), or Optuna's TPE (`pip install "
        "raytrain[optuna]`).",
    )

    @model_validator(mode="after")
    def _optuna_draws_no_grid(self) -> TuneSpec:
        grids = [k for k, d in self.search_space.items() if d.kind == "grid"]
        if self.search_alg == "optuna" and grids:
            raise ValueError(
                f"search_alg: optuna draws every value; {grids[0]} is a grid (use choice)"
            )
        return self

    @model_validator(mode="after")
    def _trials_bounded(self) -> TuneSpec:
        """num_samples times every combination of the grids, and every listed value
        together, within ``MAX_TRIALS``: Tune would generate each trial, and the sweep's
        check would validate each value."""
        listed = [
            len(getattr(d, d.kind))
            for d in self.search_space.values()
            if d.kind in ("choice", "grid")
        ]
        if sum(listed) > MAX_TRIALS:
            raise ValueError(
                f"search_space lists {sum(listed):,} values in all, more than "
                f"the limit of {MAX_TRIALS:,}"
            )
        grids = [len(d.grid) for d in self.search_space.values() if d.grid is not None]
        trials = math.prod(grids) * self.num_samples
        if trials > MAX_TRIALS:
            sizes = " x ".join(map(str, grids))
            raise ValueError(
                f"num_samples: {self.num_samples} x the grids' {sizes} "
                f"combinations is {trials:,} trials, more than the limit of "
                f"{MAX_TRIALS:,}"
            )
        return self

    @field_validator("search_space")
    @classmethod
    def _dotted_keys(cls, value: dict[str, Distribution]) -> dict[str, Distribution]:
        for key in value:
            if not key or any(not part for part in key.split(".")):
                raise ValueError(f"{key!r}: expected a dotted field of the spec")
            problem = reserved_problem(key)
            if problem:
                raise ValueError(problem)
        return value
