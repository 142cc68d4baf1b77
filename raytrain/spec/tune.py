"""The ``tune`` section: a hyperparameter sweep over the spec's own fields (``raytrain tune``).

A sweep is the spec plus this section, in the same file, rather than a sweep file beside
it: one file is what ``raytrain tune`` reads, what ``raytrain submit`` uploads, and what a
reader needs to know what a trial is. Each key of ``search_space`` is a dotted field path of
the spec (``model.init_args.lr``), so every trial is the spec with those fields set; the
sweep checks each distribution's bounds against the spec's own validation before any trial
starts (``raytrain.sweep.space``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raytrain.spec.fields import MAX_SEED, _Section

DISTRIBUTIONS = ("uniform", "loguniform", "randint", "choice", "grid")


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
            raise ValueError(f"expected exactly one of {', '.join(DISTRIBUTIONS)}, got "
                             f"{', '.join(given) or 'none'}")  # fmt: skip
        kind = given[0]
        if kind in ("uniform", "loguniform", "randint"):
            low, high = getattr(self, kind)
            if not low < high:
                raise ValueError(f"{kind}: low must be below high, got [{low}, {high}]")
            if kind == "loguniform" and low <= 0:
                raise ValueError(f"loguniform: low must be above 0, got {low}")
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
        default=4, gt=1, description="ASHA: 1/reduction_factor of trials go on at each rung."
    )
    max_t: int | None = Field(
        default=None,
        ge=1,
        description="ASHA: the most a trial trains; default: trainer.max_epochs (or max_steps).",
    )

    @model_validator(mode="after")
    def _asha_fields_only_for_asha(self) -> TrialSchedulerSpec:
        if self.name == "fifo":
            asha = {"time_attr", "grace_period", "reduction_factor", "max_t"}
            given = sorted(asha & self.model_fields_set)
            if given:
                raise ValueError(f"{', '.join(given)}: only for name: asha")
        return self


class TuneSpec(_Section):
    """A sweep: trials of the spec with the fields of ``search_space`` drawn or gridded."""

    search_space: dict[str, Distribution] = Field(
        min_length=1,
        description="Dotted spec fields and their values, e.g. `model.init_args.lr: "
        "{loguniform: [1e-4, 1e-1]}`, `data.batch_size: {choice: [32, 64]}`.",
    )
    metric: str = Field(
        min_length=1, description="The reported metric trials are compared by (`val_acc`)."
    )
    mode: Literal["min", "max"] = Field(description="Whether a lower or higher metric is better.")
    num_samples: int = Field(
        default=1, ge=1, le=10_000, description="Trials drawn (with grids: times each grid)."
    )
    max_concurrent_trials: int | None = Field(
        default=None,
        ge=1,
        description="The most trials at once; default: as many as the cluster holds.",
    )
    seed: int = Field(
        default=0, ge=0, le=MAX_SEED, description="The search's seed: the same trials each time."
    )
    scheduler: TrialSchedulerSpec = Field(default_factory=TrialSchedulerSpec)
    search_alg: Literal["random", "optuna"] = Field(
        default="random",
        description="`random` (grid for `grid` fields), or Optuna's TPE (`pip install "
        "raytrain[optuna]`).",
    )

    @model_validator(mode="after")
    def _optuna_draws_no_grid(self) -> TuneSpec:
        grids = [k for k, d in self.search_space.items() if d.kind == "grid"]
        if self.search_alg == "optuna" and grids:
            raise ValueError(f"search_alg: optuna draws every value; {grids[0]} is a grid "
                             "(use choice)")  # fmt: skip
        return self

    @field_validator("search_space")
    @classmethod
    def _dotted_keys(cls, value: dict[str, Distribution]) -> dict[str, Distribution]:
        for key in value:
            if not key or any(not part for part in key.split(".")) or key.startswith("tune."):
                raise ValueError(f"{key!r}: expected a dotted field of the spec, not tune's")
            if key == "name":
                raise ValueError("'name': each trial's name is the sweep's, numbered")
        return value
