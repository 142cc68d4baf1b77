"""The input example a trained model is logged to MLflow with, and the format it implies.

MLflow 3 saves a PyTorch model as ``pt2`` (``torch.export``: a traced graph, loaded without
unpickling code) by default, and ``pt2`` needs an input example to trace ``forward`` with.
``input_example`` finds one, in this order:

1. the model's ``example_input_array`` (Lightning's convention), when it is one tensor;
2. the data: the first rows of the val split (else train), read on the driver and made
   tensors by the same conversion the workers' loaders use (``arrow_batch_to_tensors``),
   when ``forward`` takes one tensor whose parameter name is one of the batch's columns
   (``forward(self, pixels)`` and a ``pixels`` column);
3. none, with the reason: the model is then logged in MLflow's ``pickle`` format, which
   needs no example (a run tag says so).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from raytrain.spec import JobSpec

if TYPE_CHECKING:
    import torch

# Rows of data in a built example: more than one, so torch.export keeps the batch dynamic.
EXAMPLE_ROWS = 2


def input_example(model: torch.nn.Module, job: JobSpec | None = None) -> tuple[Any | None, str]:
    """(a tensor ``model(example)`` accepts, where it came from), or (None, why none)."""
    import torch

    declared = getattr(model, "example_input_array", None)
    if isinstance(declared, torch.Tensor):
        return declared, "example_input_array"
    if declared is not None:
        return None, f"example_input_array is a {type(declared).__name__}, not one tensor"
    name, why = _forward_input(model)
    if name is None:
        return None, why
    if job is None:
        return None, "the model has no example_input_array"
    batch, where = first_batch(job)
    if batch is None:
        return None, where
    if name not in batch:
        return None, (
            f"forward's input {name!r} is not a column of {where} "
            f"(columns: {', '.join(sorted(batch))})"
        )
    example = batch[name]
    try:
        with torch.no_grad():
            output = model(example)
    except Exception as exc:
        return None, f"forward({name}=...) on {where} failed: {type(exc).__name__}: {exc}"
    if not isinstance(output, torch.Tensor):
        return None, f"forward returns a {type(output).__name__}, not a tensor"
    return example, f"{where}, column {name!r}"


def _forward_input(model: torch.nn.Module) -> tuple[str | None, str]:
    """The name of ``forward``'s one required input, or (None, why it has not one)."""
    import torch

    forward = getattr(type(model), "forward", None)
    base = {torch.nn.Module.forward}
    try:
        import lightning.pytorch as pl

        base.add(pl.LightningModule.forward)
    except ImportError:
        pass
    if forward is None or forward in base:
        return None, "the model defines no forward"
    params = list(inspect.signature(model.forward).parameters.values())
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]
    if len(required) != 1:
        return None, f"forward takes {len(required)} required inputs, not one tensor"
    return required[0].name, ""


def first_batch(job: JobSpec) -> tuple[dict[str, Any] | None, str]:
    """The first rows of the job's val split (else train) as the workers' loaders make
    them (a dict of tensors) and which split they are; (None, why) when that cannot be done
    here: images are decoded, and ``data.preprocess`` is applied, by Ray Data tasks."""
    data = job.files
    if data is None:
        return None, "the data is built in the workers (a DataModule or the model's loaders)"
    first = data.train_sources()[0][1]
    name, source = ("val", data.val) if data.val is not None else ("train", first)
    where = f"data.{name} ({source.uri})"
    if source.format == "images":
        return None, f"{where} is images, decoded by Ray Data: no example is built from it"
    if data.preprocess:
        return None, f"data.preprocess ({data.preprocess}) runs in Ray Data: no example is built"
    try:
        import pyarrow.dataset as pads
        from ray.data.util.torch_utils import arrow_batch_to_tensors

        from raytrain import storage

        fs, path = storage.filesystem(source.uri, job.storage)
        table = pads.dataset(path, filesystem=fs, format=source.format).head(
            EXAMPLE_ROWS, columns=data.columns or None
        )
        return arrow_batch_to_tensors(table, combine_chunks=True), where
    except Exception as exc:
        return None, f"cannot read {where} for an example: {type(exc).__name__}: {exc}"
