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

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from raytrain.spec.classes import normalize_class_path

# The class paths Lightning exports ModelCheckpoint under (normalized, ``module:Class``).
MODEL_CHECKPOINT_PATHS = frozenset(
    {
        "lightning.pytorch.callbacks:ModelCheckpoint",
        "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint",
        "pytorch_lightning.callbacks:ModelCheckpoint",
        "pytorch_lightning.callbacks.model_checkpoint:ModelCheckpoint",
    }
)

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
# Every argument of Lightning 2.6's ModelCheckpoint: any other key is a typo, refused as
# jsonargparse refuses one in any other class (pinned against the installed signature).
ARGUMENTS = frozenset(
    {
        "dirpath",
        "filename",
        "monitor",
        "verbose",
        "save_last",
        "save_top_k",
        "save_on_exception",
        "save_weights_only",
        "mode",
        "auto_insert_metric_name",
        "every_n_train_steps",
        "train_time_interval",
        "every_n_epochs",
        "save_on_train_epoch_end",
        "enable_version_counter",
    }
)
# The most checkpoints a run keeps, and the longest interval in steps or epochs: past these a
# value is a slip (1e20), not a plan.
MAX_KEEP = 100_000
MAX_INTERVAL = 10**9


def _honoured_value(key: str, value: Any) -> tuple[Any, str | None]:
    """``value`` of the honoured argument ``key`` as raytrain's field takes it, or a reason it
    cannot be, as Lightning's ModelCheckpoint would refuse it (a value it would coerce or
    refuse at the run's start is refused here, before Ray). ``(None, None)``: off."""
    if key == "monitor":
        return (value, None) if isinstance(value, str) and value else (None, "a metric name")
    if key == "mode":
        return (value, None) if value in ("min", "max") else (None, "'min' or 'max'")
    if not isinstance(value, int) or isinstance(value, bool):
        return None, "a whole number"
    if key == "save_top_k":
        if value == 0:
            return None, (
                "0 saves nothing, and a run resumes from its checkpoints: give -1 "
                "(all) or at least 1"
            )
        if value < -1 or value > MAX_KEEP:
            return None, f"-1 (all) or 1 to {MAX_KEEP:,}"
        return (None if value == -1 else value), None
    if value < 0 or value > MAX_INTERVAL:
        return None, f"0 (off) to {MAX_INTERVAL:,}"
    return (value or None), None


def is_model_checkpoint(entry: object) -> bool:
    """Whether a ``trainer.callbacks`` entry (a mapping or a class name) is Lightning's
    ModelCheckpoint."""
    path = entry.get("class_path") if isinstance(entry, dict) else entry
    if not isinstance(path, str):
        return False
    try:
        return normalize_class_path(path, "callback") in MODEL_CHECKPOINT_PATHS
    except ValueError:
        return False


class Adopted(NamedTuple):
    """What ``adopt_model_checkpoint`` made of a tree."""

    tree: dict[str, Any]  # without the ModelCheckpoint, its settings in ``checkpoint``
    notes: list[str]  # what was adopted, what is ignored: to print
    problems: list[str]
    taken_from: int | None  # the callback's index in ``trainer.callbacks`` as written


def adopt_model_checkpoint(tree: dict[str, Any]) -> Adopted:
    """``tree`` with a ModelCheckpoint in ``trainer.callbacks`` taken out and its settings
    moved into ``checkpoint`` (fields the section sets win). ``tree`` is not changed."""
    trainer = tree.get("trainer")
    if not isinstance(trainer, dict):
        return Adopted(tree, [], [], None)
    callbacks = trainer.get("callbacks")
    listed = callbacks if isinstance(callbacks, list) else [callbacks]
    found = [(i, c) for i, c in enumerate(listed) if is_model_checkpoint(c)]
    if not found:
        return Adopted(tree, [], [], None)
    if len(found) > 1:
        where = " and ".join(f"trainer.callbacks.{i}" for i, _ in found)
        return Adopted(
            tree,
            [],
            [
                f"trainer.callbacks: two ModelCheckpoints ({where}); raytrain "
                "keeps one set of checkpoints: give one"
            ],
            None,
        )
    index, entry = found[0]
    where = f"trainer.callbacks.{index}"
    # The tree without the callback: what the rest of the spec is checked on, so a problem
    # found here is said once, not again by the spec's own check of the entry.
    out = dict(tree)
    out["trainer"] = {**trainer, "callbacks": [c for i, c in enumerate(listed) if i != index]}
    args, problem = _init_args(where, entry)
    if problem is not None:
        return Adopted(out, [], [problem], index)
    section = tree.get("checkpoint")
    section = dict(section) if isinstance(section, dict) else {}
    moved = _move(where, args, section)
    if moved.problems:
        return Adopted(out, [], moved.problems, index)
    out["checkpoint"] = section
    said = ", ".join(moved.adopted) or "nothing to adopt"
    kept = f" ({', '.join(moved.kept)} set in the spec win)" if moved.kept else ""
    notes = [f"{where}: ModelCheckpoint becomes raytrain's checkpoint settings: {said}{kept}"]
    if moved.ignored:
        notes.append(
            f"warning: {where}: ModelCheckpoint options ignored: {'; '.join(moved.ignored)}"
        )
    return Adopted(out, notes, [], index)


def _init_args(where: str, entry: object) -> tuple[dict[str, Any], str | None]:
    """The entry's ``init_args`` (a copy), or the problem with them: not a mapping, or a
    name ModelCheckpoint does not take."""
    args = entry.get("init_args") if isinstance(entry, dict) else None
    if args is not None and not isinstance(args, dict):
        return {}, (
            f"{where}.init_args: a mapping of ModelCheckpoint's arguments, got "
            f"{type(args).__name__}"
        )
    args = dict(args or {})
    unknown = sorted(str(k) for k in args if k not in ARGUMENTS)
    if unknown:
        near = {k: difflib.get_close_matches(k, ARGUMENTS, n=1) for k in unknown}
        said = ", ".join(k + (f" (did you mean {near[k][0]}?)" if near[k] else "") for k in unknown)
        return args, f"{where}.init_args: ModelCheckpoint takes no {said}"
    return args, None


@dataclass
class _Moved:
    """What ``_move`` did with each argument: moved into the section (``adopted``), left
    to a field the spec sets (``kept``), dropped (``ignored``), or refused (``problems``)."""

    adopted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _move(where: str, args: dict[str, Any], section: dict[str, Any]) -> _Moved:
    """ModelCheckpoint's ``args`` into the ``checkpoint`` ``section`` (changed in place):
    each honoured one where the section does not set it already."""
    moved = _Moved()
    if args.pop("save_weights_only", False):
        moved.problems.append(
            f"{where}.init_args.save_weights_only: raytrain's checkpoints hold the "
            "optimizer's and loops' state a resume needs; remove it (export a "
            "checkpoint's weights with `raytrain export`)"
        )
    dirpath = args.pop("dirpath", None)
    if dirpath is not None:
        moved.ignored.append(f"dirpath {dirpath!r} (checkpoints go under checkpoint.storage)")
    filename = args.pop("filename", None)
    if filename is not None:
        moved.ignored.append(f"filename {filename!r} (raytrain names checkpoints checkpoint_N)")
    for key, given in args.items():
        target = HONOURED.get(key)
        if target is None:
            if key not in ACCEPTED and given is not None:
                moved.ignored.append(f"{key}={given!r} (no counterpart in checkpoint.*)")
            continue
        if given is None:
            continue
        value, reason = _honoured_value(key, given)
        if reason is not None:
            moved.problems.append(f"{where}.init_args.{key}: {reason}, got {repr(given)[:80]}")
        elif value is None and key != "save_top_k":  # 0: off, as in Lightning
            continue
        elif target in section:
            moved.kept.append(f"checkpoint.{target}")
        else:
            section[target] = value
            moved.adopted.append(f"{key} → checkpoint.{target}={value!r}")
    return moved


_CALLBACK_INDEX = re.compile(r"\btrainer\.callbacks\.(\d+)\b")


def as_written(problem: str, taken_from: int | None) -> str:
    """``problem`` (about the tree the ModelCheckpoint was taken out of) with each
    ``trainer.callbacks.N`` numbered as the user's list is.

    Invariant: an index below ``taken_from`` is unchanged, one at or above it is one more
    (the entries after the callback moved down by one when it was taken out); with
    ``taken_from`` None, ``problem`` is returned as it is."""
    if taken_from is None:
        return problem

    def renumber(found: re.Match[str]) -> str:
        index = int(found.group(1))
        return f"trainer.callbacks.{index + 1 if index >= taken_from else index}"

    return _CALLBACK_INDEX.sub(renumber, problem)
