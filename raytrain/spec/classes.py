"""Classes named in a spec as LightningCLI names them: ``{class_path, init_args}``.

A class path may be written as LightningCLI writes it (dotted, ``pkg.mod.Class``), as raytrain
always has (``pkg.mod:Class``), or, for the kinds LightningCLI resolves by short name
(callbacks, loggers, optimizers, schedulers), as the bare class name (``EarlyStopping``).
Validation turns each into the one form the rest of raytrain reads, ``pkg.mod:Class``,
without importing anything: whether the class exists, and takes ``init_args``, is checked
by preflight (``driver.class_check``).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from raytrain.spec.fields import _Section

_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_COLON = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_BARE = re.compile(r"^[A-Za-z_]\w*$")

# The module a bare class name of each kind is in (LightningCLI's registries hold these
# modules' classes), and the names found elsewhere: LightningCLI's own ReduceLROnPlateau,
# which takes the ``monitor`` its ``configure_optimizers`` needs.
SHORT_NAMES: dict[str, str] = {
    "callback": "lightning.pytorch.callbacks",
    "logger": "lightning.pytorch.loggers",
    "optimizer": "torch.optim",
    "lr_scheduler": "torch.optim.lr_scheduler",
}
SHORT_NAME_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("lr_scheduler", "ReduceLROnPlateau"): "lightning.pytorch.cli",
}


def normalize_class_path(value: str, kind: str | None = None) -> str:
    """``pkg.mod.Class`` or ``pkg.mod:Class`` as ``pkg.mod:Class``; a bare name of a kind
    with short names as ``<its module>:Name``.

    Pure, and the identity on its own output: a normalized path normalizes to itself."""
    if _COLON.match(value):
        return value
    if _DOTTED.match(value):
        module, _, name = value.rpartition(".")
        return f"{module}:{name}"
    if kind in SHORT_NAMES and _BARE.match(value):
        return f"{SHORT_NAME_EXCEPTIONS.get((kind, value), SHORT_NAMES[kind])}:{value}"
    expected = "`package.module.Class` or `package.module:Class`"
    if kind in SHORT_NAMES:
        expected += f", or a class name from {SHORT_NAMES[kind]}"
    raise ValueError(f"expected {expected}, got {value!r}")


class ClassSpec(_Section):
    """A class and its constructor's keyword arguments; a plain string is the class path."""

    # The kind of class, for short names (a subclass sets it; None: full paths only).
    kind: ClassVar[str | None] = None

    class_path: str = Field(
        description="The class: `package.module.Class` (as LightningCLI writes it) or "
        "`package.module:Class`."
    )
    init_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the class's constructor."
    )
    dict_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Arguments for a constructor's `**kwargs` (LightningCLI's `dict_kwargs`): "
        "given as they are, unchecked; a key in its signature goes in `init_args`.",
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_string(cls, value: Any) -> Any:
        return {"class_path": value} if isinstance(value, str) else value

    @field_validator("class_path")
    @classmethod
    def _normalize(cls, value: str) -> str:
        return normalize_class_path(value, cls.kind)

    @field_validator("init_args", "dict_kwargs", mode="before")
    @classmethod
    def _null_args(cls, value: Any) -> Any:
        return {} if value is None else value  # LightningCLI writes `init_args:` empty


class CallbackSpec(ClassSpec):
    """A Lightning callback (`trainer.callbacks`)."""

    kind = "callback"


class LoggerSpec(ClassSpec):
    """A Lightning logger (`trainer.logger`)."""

    kind = "logger"


class OptimizerSpec(ClassSpec):
    """A torch optimizer (LightningCLI's `optimizer`)."""

    kind = "optimizer"


class SchedulerSpec(ClassSpec):
    """A torch LR scheduler (LightningCLI's `lr_scheduler`)."""

    kind = "lr_scheduler"
