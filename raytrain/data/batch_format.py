"""A batch in the shape the model's steps read (``data.batch_format``): shared by every
loader, cached or streamed."""

from __future__ import annotations

from typing import Any


def batch_as(batch: dict[str, Any], columns: list[str] | None) -> Any:
    """A batch as the model's steps read it: the dict of tensors by column, or with
    ``columns`` (``data.batch_format: tuple``) a tuple of them in that order."""
    return batch if columns is None else tuple(batch[name] for name in columns)
