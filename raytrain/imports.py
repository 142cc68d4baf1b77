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
