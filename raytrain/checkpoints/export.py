"""A checkpoint's weights as one plain state dict file, for serving.

A raytrain checkpoint holds Lightning's whole training state: under DDP or a full FSDP
state dict one file, under sharded FSDP or model parallelism a folder of torch distributed
checkpoint shards, one per rank (DTensors are saved with their global shapes).
``export_checkpoint`` reads either (from local storage or a URI), keeps only the
model's weights, and writes them as one file that ``model.load_state_dict`` accepts: torch
format (``.pt``/``.pth``/``.bin``/anything else) or safetensors (``.safetensors``, when the
``safetensors`` package is installed). No process group is needed: the shards are merged
here, on one CPU.

Nothing in a checkpoint runs: every part is read through ``raytrain.checkpoints.safe_load``
(``weights_only=True`` and a restricted reader for sharded metadata). A file that is not a
checkpoint, or holds something else, is a ``StorageError`` naming it (exit 2).
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from raytrain import storage
from raytrain.checkpoints.layout import CKPT_FILE, lightning_checkpoint
from raytrain.errors import StorageError
from raytrain.spec import JobSpec, StorageSpec

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

# Prefixes Lightning's strategy wrappers may leave on state dict keys.
_PREFIXES = ("_forward_module.", "_fsdp_wrapped_module.", "module.")
# The key of the model's weights in a sharded checkpoint, by the strategy that wrote it.
_DCP_MODEL_KEYS = ("model", "state_dict")


def model_state_dict(checkpoint: str, label: str | None = None) -> dict[str, Any]:
    """The model weights of the raytrain checkpoint at local path ``checkpoint``: its
    folder, or the ``checkpoint.ckpt`` inside it (a file or a sharded folder). ``label``
    names it in errors (the URI it came from)."""
    from raytrain.checkpoints import safe_load

    path, name = lightning_checkpoint(checkpoint, label)
    if os.path.isdir(path):  # sharded: merge the model's shards
        # Lightning's FSDP strategy names them "model", its ModelParallelStrategy "state_dict"
        shards = safe_load.load_dcp(path, keys=set(_DCP_MODEL_KEYS), label=name)
        state = next((shards[k] for k in _DCP_MODEL_KEYS if k in shards), None)
        if not isinstance(state, dict):
            raise StorageError(f"{name}: a sharded checkpoint without the model's weights")
    elif os.path.isfile(path):
        loaded = safe_load.load_torch_file(path, name)
        state = loaded.get("state_dict") if isinstance(loaded, dict) else None
        if not isinstance(state, dict):
            what = (
                f"keys: {', '.join(map(str, list(loaded)[:8]))}"
                if isinstance(loaded, dict)
                else f"a {type(loaded).__name__}"
            )
            raise StorageError(
                f"{name}: not a Lightning checkpoint (no state_dict of weights; {what})"
            )
    else:
        raise StorageError(f"{name}: not a file or folder")
    return {_strip(str(key)): value for key, value in state.items()}


def _strip(key: str) -> str:
    for prefix in _PREFIXES:
        key = key.replace(prefix, "")
    return key


def _download(checkpoint: str, options: StorageSpec | None, tmp: str) -> str:
    """A local copy of the checkpoint at URI ``checkpoint`` (a folder or a file) in ``tmp``.

    ``pyarrow.fs.copy_files`` of a folder creates the folders it finds below it, not the
    destination itself, so a folder of files (every checkpoint) needs it made first.
    """
    import pyarrow.fs as pafs

    fs, path = storage.filesystem(checkpoint, options)
    try:
        kind = fs.get_file_info(path).type
        if kind == pafs.FileType.NotFound:
            raise StorageError(f"{checkpoint}: no such file or folder")
        local = os.path.join(tmp, "checkpoint")
        if kind == pafs.FileType.Directory:
            os.makedirs(local)
        pafs.copy_files(path, local, source_filesystem=fs)
    except StorageError:
        raise
    except Exception as exc:
        raise StorageError(f"{checkpoint}: cannot read it: {storage.describe(exc)}") from None
    return local


def checkpoint_weights(checkpoint: str, options: StorageSpec | None = None) -> dict[str, Any]:
    """``checkpoint``'s model weights (a local folder or file, or a URI; shards merged), as
    tensors; ``options`` is the spec's ``storage`` section (endpoints) for a URI."""
    import torch

    with tempfile.TemporaryDirectory(prefix="raytrain-export-") as tmp:
        if storage.is_uri(checkpoint):
            state = model_state_dict(_download(checkpoint, options, tmp), label=checkpoint)
        else:
            state = model_state_dict(storage.resolve(checkpoint), label=checkpoint)
    weights = {k: v.detach().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not weights:
        raise StorageError(f"{checkpoint}: its state_dict holds no tensors")
    return weights


def trained_model(job: JobSpec, checkpoint: str) -> LightningModule:
    """The spec's model, built as the workers build it (nested ``class_path`` blocks too:
    ``lightning_config.build_model``), with ``checkpoint``'s weights (strict), in eval mode,
    on CPU: what MLflow logs and serving loads."""
    from raytrain.spec.lightning_config import build_model

    weights = checkpoint_weights(checkpoint, job.storage)  # checked before building the model
    model = build_model(job)
    model.load_state_dict(weights, strict=True)
    return model.eval()


def _check_not_inside(out: str, path: str, checkpoint: str) -> None:
    """Refuse an ``out`` inside the local ``checkpoint`` (its folder or its file, through
    links): the rename would replace a committed checkpoint by its weights, or add to it."""
    if storage.is_uri(checkpoint):
        return
    source = os.path.realpath(storage.resolve(checkpoint))
    if os.path.basename(source) == CKPT_FILE:  # the file inside a checkpoint folder
        source = os.path.dirname(source)
    target = os.path.realpath(path)
    if target == source or target.startswith(source.rstrip(os.sep) + os.sep):
        raise StorageError(
            f"{out}: is inside the checkpoint {checkpoint}; write the weights elsewhere "
            "(exporting never changes a checkpoint)"
        )


def export_checkpoint(checkpoint: str, out: str) -> dict[str, Any]:
    """Write ``checkpoint``'s model weights (a local folder or URI) to the file ``out``;
    returns the state dict written. Written to a temporary file beside ``out`` and renamed,
    so a failure leaves no partial file."""
    import torch

    if storage.is_uri(out):
        raise StorageError(f"{out}: export writes a local file; copy it to storage after")
    path = storage.output_file(out)
    save_file: Any = None
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file as save_safetensors

            save_file = save_safetensors
        except ImportError:
            raise StorageError(
                f"{out}: safetensors is not installed (pip install safetensors), or name "
                "the file .pt for torch format"
            ) from None
    state = checkpoint_weights(checkpoint)  # first: what is not a checkpoint is said so
    _check_not_inside(out, path, checkpoint)
    partial = f"{path}.partial-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if save_file is not None:
            save_file(state, partial)
        else:  # opened here: torch's own open raises a RuntimeError, not an OSError
            with open(partial, "wb") as handle:
                torch.save(state, handle)
        os.replace(partial, path)
    except OSError as exc:
        raise StorageError(f"{out}: cannot write it: {exc.strerror or exc}") from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return state
