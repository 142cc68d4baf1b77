"""A user's ``ModelCheckpoint`` in ``trainer.callbacks``, read as raytrain's ``checkpoint``.

LightningCLI configs name a ``ModelCheckpoint`` more than any other callback. raytrain saves
checkpoints itself (into ``checkpoint.storage``, committed by Ray, resumable), so the
callback is not built; its settings become the ``checkpoint`` section's where that section
does not set them: ``monitor``, ``mode``, ``save_top_k`` (→ ``keep``; -1: all),
``every_n_epochs``, ``every_n_train_steps`` (→ ``every_n_steps``). ``save_last`` asks for
what raytrain does anyway (the latest checkpoint is always kept: a run resumes from it).

What raytrain cannot honour is named: ``save_weights_only: true`` is refused (a resume
needs the optimizer's state); a ``dirpath`` outside the run's folder, a custom ``filename``
and options without a counterpart are ignored with a warning. Two ModelCheckpoints are
refused, naming both. Pure: a tree in, a tree, notes and problems out; nothing imported
(the callback is recognised by its class path, as Lightning exports it).
"""

from __future__ import annotations

from typing import Any

from raytrain.spec.classes import normalize_class_path

# The class paths Lightning exports ModelCheckpoint under (normalized, ``module:Class``).
MODEL_CHECKPOINT_PATHS = frozenset({
    "lightning.pytorch.callbacks:ModelCheckpoint",
    "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint",
    "pytorch_lightning.callbacks:ModelCheckpoint",
    "pytorch_lightning.callbacks.model_checkpoint:ModelCheckpoint",
})  # fmt: skip

# ModelCheckpoint's argument → raytrain's checkpoint field.
HONOURED = {
    "monitor": "monitor",
    "mode": "mode",
    "save_top_k": "keep",
    "every_n_epochs": "every_n_epochs",
    "every_n_train_steps": "every_n_steps",
}
# Arguments that ask for what raytrain does anyway, at any value.
ACCEPTED = frozenset({"save_last", "verbose", "auto_insert_metric_name", "enable_version_counter"})


def is_model_checkpoint(entry: Any) -> bool:
    """Whether a ``trainer.callbacks`` entry (a mapping or a class name) is Lightning's
    ModelCheckpoint."""
    path = entry.get("class_path") if isinstance(entry, dict) else entry
    if not isinstance(path, str):
        return False
    try:
        return normalize_class_path(path, "callback") in MODEL_CHECKPOINT_PATHS
    except ValueError:
        return False


def adopt_model_checkpoint(tree: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """``tree`` with a ModelCheckpoint in ``trainer.callbacks`` taken out and its settings
    moved into ``checkpoint`` (fields the section sets win). Returns the new tree, notes to
    print (what was adopted, what is ignored) and problems. ``tree`` is not changed."""
    trainer = tree.get("trainer")
    if not isinstance(trainer, dict):
        return tree, [], []
    callbacks = trainer.get("callbacks")
    listed = callbacks if isinstance(callbacks, list) else [callbacks]
    found = [(i, c) for i, c in enumerate(listed) if is_model_checkpoint(c)]
    if not found:
        return tree, [], []
    if len(found) > 1:
        where = " and ".join(f"trainer.callbacks.{i}" for i, _ in found)
        return tree, [], [f"trainer.callbacks: two ModelCheckpoints ({where}); raytrain keeps "
                          "one set of checkpoints: give one"]  # fmt: skip
    index, entry = found[0]
    field = f"trainer.callbacks.{index}"
    args = entry.get("init_args") if isinstance(entry, dict) else None
    args = dict(args or {})
    section = tree.get("checkpoint")
    section = dict(section) if isinstance(section, dict) else {}
    adopted, kept, ignored, problems = [], [], [], []
    if args.pop("save_weights_only", False):
        problems.append(f"{field}.init_args.save_weights_only: raytrain's checkpoints hold the "
                        "optimizer's and loops' state a resume needs; remove it (export a "
                        "checkpoint's weights with `raytrain export`)")  # fmt: skip
    dirpath = args.pop("dirpath", None)
    if dirpath is not None:
        ignored.append(f"dirpath {dirpath!r} (checkpoints go under checkpoint.storage)")
    filename = args.pop("filename", None)
    if filename is not None:
        ignored.append(f"filename {filename!r} (raytrain names checkpoints checkpoint_N)")
    for key, value in args.items():
        target = HONOURED.get(key)
        if target is None:
            if key not in ACCEPTED and value is not None:
                ignored.append(f"{key}={value!r} (no counterpart in checkpoint.*)")
            continue
        if value is None:
            continue
        if key == "save_top_k":
            value = None if value == -1 else max(int(value), 1)
        if target in section:
            kept.append(f"checkpoint.{target}")
            continue
        section[target] = value
        adopted.append(f"{key} → checkpoint.{target}={value!r}")
    if problems:
        return tree, [], problems
    out = dict(tree)
    out["trainer"] = {**trainer, "callbacks": [c for i, c in enumerate(listed) if i != index]}
    out["checkpoint"] = section
    said = ", ".join(adopted) or "nothing to adopt"
    notes = [f"{field}: ModelCheckpoint becomes raytrain's checkpoint settings: {said}"
             + (f" ({', '.join(kept)} set in the spec win)" if kept else "")]  # fmt: skip
    if ignored:
        notes.append(f"warning: {field}: ModelCheckpoint options ignored: {'; '.join(ignored)}")
    return out, notes, []
