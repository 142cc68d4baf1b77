"""The ``trainer`` section: the Lightning Trainer's arguments.

raytrain's own fields are typed and described here. Any other argument of
``lightning.pytorch.Trainer`` (``val_check_interval``, ``limit_train_batches``,
``deterministic``, ...) may stand beside them, as in a LightningCLI config, and is handed to
the Trainer as written: the section checks each name against the Trainer's arguments
(``lightning_cli.TRAINER_ARGUMENTS``), so a typo is still an error naming the field.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from raytrain.spec.classes import CallbackSpec, LoggerSpec
from raytrain.spec.fields import (
    MAX_ACCUMULATION,
    MAX_SEED,
    _admits_none,
    _refuse_nul,
    _Section,
)
from raytrain.spec.lightning_cli import OWNED_TRAINER_ARGUMENTS, TRAINER_ARGUMENTS

Precision = Literal[
    "32-true", "32", "64-true", "64", "16-mixed", "16", "bf16-mixed", "bf16", "16-true", "bf16-true"
]
Profiler = Literal["simple", "advanced", "pytorch"]


class TrainerSpec(_Section):
    # Other Trainer arguments are kept as written (checked by name in ``_known_arguments``).
    model_config = ConfigDict(extra="allow")

    max_epochs: int | None = Field(default=10, ge=1, description="Stop after this many epochs.")
    max_steps: int = Field(default=-1, ge=-1, description="Stop after this many steps; -1: off.")
    precision: Precision | Literal["auto"] = Field(
        default="auto",
        description="Lightning precision; `auto`: bf16-mixed where the hardware computes "
        "bf16 natively (GPUs from Ampere on, CPUs with AMX or AVX512-BF16), else 32-true.",
    )
    accumulate_grad_batches: int = Field(
        default=1,
        ge=1,
        le=MAX_ACCUMULATION,
        description=f"Batches per step (at most {MAX_ACCUMULATION}).",
    )
    gradient_clip_val: float | None = Field(default=None, ge=0, description="Clip grad norm.")
    check_val_every_n_epoch: int = Field(default=1, ge=1, description="Validate every N epochs.")
    log_every_n_steps: int = Field(default=50, ge=1, description="Report metrics every N steps.")
    seed: int | None = Field(
        default=42,
        ge=0,
        le=MAX_SEED,
        description="Seed for model init and RNGs, 0 to 2**32-1; null: none. LightningCLI's "
        "`seed_everything` sets it (`true`: a seed drawn from the run's name).",
    )
    callbacks: list[CallbackSpec] = Field(
        default_factory=list,
        max_length=100,  # each is parsed by jsonargparse: 3,000 took over a minute to refuse
        description="Lightning callbacks as `{class_path, init_args}` (or a class name from "
        "lightning.pytorch.callbacks), run on every rank, their state in every checkpoint; "
        "at most 100.",
    )
    logger: list[LoggerSpec] = Field(
        default_factory=list,
        max_length=100,
        description="Loggers beside MLflow (TensorBoardLogger, CSVLogger, ...): rank 0 writes; "
        "a relative save_dir is under the run's storage. `true`/`false`/null: none; at most "
        "100.",
    )

    profiler: Profiler | None = Field(
        default=None,
        description="Lightning's profiler (`simple`, `advanced`, `pytorch`: a trace for "
        "Perfetto or chrome://tracing); its reports go to the run's `profiles/` folder in "
        "checkpoint.storage and to MLflow's artifacts.",
    )
    profile_all_ranks: bool = Field(
        default=False, description="Profile every rank, not only rank 0."
    )

    @model_validator(mode="before")
    @classmethod
    def _known_arguments(cls, value: Any) -> Any:
        """Nulls as Lightning's default (``--print_config`` writes every argument, most of
        them null); every other key an argument of the Trainer that raytrain does not set."""
        if not isinstance(value, dict):
            return value
        kept = {}
        known = set(cls.model_fields) | TRAINER_ARGUMENTS
        unknown = [key for key in value if key not in known]
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), sorted(known), n=1)
            raise PydanticCustomError(
                "unknown_argument",
                "unknown field (not raytrain's, nor an argument of lightning.pytorch.Trainer"
                "{hint}){also}",
                {
                    "field": unknown[0],
                    "hint": f"; did you mean {close[0]}?" if close else "",
                    "also": f"; nor are {', '.join(map(str, unknown[1:]))}" if unknown[1:] else "",
                },
            )
        for key, item in value.items():
            field = cls.model_fields.get(key)
            if item is None and (field is None or not _admits_none(field.annotation)):
                continue
            if key in OWNED_TRAINER_ARGUMENTS:
                raise PydanticCustomError(
                    "unknown_argument",
                    "raytrain sets this itself; use {instead}",
                    {"field": key, "instead": OWNED_TRAINER_ARGUMENTS[key][1]},
                )
            if field is None:
                _refuse_nul(item)
            kept[key] = item
        return kept

    @field_validator("callbacks", "logger", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        if value is None or isinstance(value, bool):
            return []  # Lightning's own default logger is MLflow's here
        return [value] if isinstance(value, dict | str) else value

    @property
    def passthrough(self) -> dict[str, Any]:
        """The Trainer arguments written beside raytrain's fields, as written."""
        return dict(self.model_extra or {})
