"""A checkpoint's weights as one plain state dict file, for serving.

A raytrain checkpoint holds Lightning's whole training state: under DDP or a full FSDP
state dict one file, under sharded FSDP a folder of torch distributed checkpoint shards, one
per rank. ``export_checkpoint`` reads either (from local storage or a URI), keeps only the
model's weights, and writes them as one file that ``model.load_state_dict`` accepts: torch
format (``.pt``/``.pth``/``.bin``/anything else) or safetensors (``.safetensors``, when the
``safetensors`` package is installed). No process group is needed: the shards are merged
here, on one CPU.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from raytrain import storage
from raytrain.checkpoint import CKPT_FILE
from raytrain.errors import StorageError
from raytrain.spec import JobSpec, StorageSpec

# Prefixes Lightning's strategy wrappers may leave on state dict keys.
_PREFIXES = ("_forward_module.", "_fsdp_wrapped_module.", "module.")


def model_state_dict(checkpoint_dir: str) -> dict[str, Any]:
    """The model weights of the raytrain checkpoint in local folder ``checkpoint_dir``."""
    import torch

    path = os.path.join(checkpoint_dir, CKPT_FILE)
    if os.path.isdir(path):  # sharded FSDP: merge the shards
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory(prefix="raytrain-export-") as tmp:
            merged = os.path.join(tmp, "merged.pt")
            dcp_to_torch_save(path, merged)
            state = torch.load(merged, map_location="cpu", weights_only=False)["model"]
    elif os.path.isfile(path):
        state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    else:
        raise StorageError(f"{checkpoint_dir}: not a raytrain checkpoint (no {CKPT_FILE})")
    return {_strip(key): value for key, value in state.items()}


def _strip(key: str) -> str:
    for prefix in _PREFIXES:
        key = key.replace(prefix, "")
    return key


def checkpoint_weights(checkpoint: str, options: StorageSpec | None = None) -> dict[str, Any]:
    """``checkpoint``'s model weights (a local folder or URI; shards merged), as tensors;
    ``options`` is the spec's ``storage`` section (endpoints) for a URI."""
    import torch

    local = checkpoint
    with tempfile.TemporaryDirectory(prefix="raytrain-export-") as tmp:
        if storage.is_uri(checkpoint):
            import pyarrow.fs as pafs

            fs, path = storage.filesystem(checkpoint, options)
            local = os.path.join(tmp, "checkpoint")
            pafs.copy_files(path, local, source_filesystem=fs)
        state = model_state_dict(local)
    return {k: v.detach().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}


def trained_model(job: JobSpec, checkpoint: str) -> Any:
    """The spec's model class with ``checkpoint``'s weights (strict), in eval mode, on CPU:
    what MLflow logs and serving loads."""
    from raytrain.preflight import import_object

    model = import_object(job.model.class_path)(**job.model.init_args)
    model.load_state_dict(checkpoint_weights(checkpoint, job.storage), strict=True)
    return model.eval()


def export_checkpoint(checkpoint: str, out: str) -> dict[str, Any]:
    """Write ``checkpoint``'s model weights (a local folder or URI) to the file ``out``;
    returns the state dict written."""
    import torch

    state = checkpoint_weights(checkpoint)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if out.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise StorageError(
                f"{out}: safetensors is not installed (pip install safetensors), or name "
                "the file .pt for torch format"
            ) from None
        save_file(state, out)
    else:
        torch.save(state, out)
    return state
