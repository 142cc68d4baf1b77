"""The one way raytrain turns a spec's ``package.module:Name`` into the object it names.

The model class, ``data.prepare`` and ``data.preprocess`` are all named this way. Importing
runs the user's module, so the driver calls this only where it must (see
``driver.source_check``, which reads a module's source instead).
"""

from __future__ import annotations

import importlib
from typing import Any


def import_object(path: str) -> Any:
    """Import ``package.module:Name`` and return the object ``Name`` (which may be dotted:
    ``module:Outer.Inner``)."""
    module_name, _, attr = path.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        value = getattr(value, part)
    return value


OLD_NAMESPACE_HINT = (
    "it derives from the older pytorch_lightning package, whose classes are not "
    "lightning.pytorch's (the Trainer, Ray's strategies and raytrain use lightning.pytorch): "
    "change `import pytorch_lightning as pl` to `import lightning.pytorch as pl`"
)


def old_namespace(cls: type) -> bool:
    """Whether ``cls`` derives from a class of the ``pytorch_lightning`` package (read from
    its MRO's module names, without importing that package)."""
    return any(k.__module__.split(".")[0] == "pytorch_lightning" for k in cls.__mro__)
