"""LightningCLI's ``fit`` config, read as a raytrain spec.

A LightningCLI config (what ``--print_config`` writes) has ``seed_everything``, ``trainer``
with any argument of ``lightning.pytorch.Trainer``, ``model`` and ``data`` as
``{class_path, init_args}``, ``optimizer``, ``lr_scheduler`` and ``ckpt_path``. raytrain's
own sections stand beside them. ``lightning_cli_tree`` maps the few LightningCLI keys that
raytrain holds elsewhere onto raytrain's fields, before validation, and names each that it
cannot take. It is pure: a tree in, a tree and problems out; nothing is imported.

What raytrain owns, and so maps or refuses (``OWNED_TRAINER_ARGUMENTS``): where the workers
run (``accelerator``, ``devices``, ``num_nodes``), how they train together (``strategy``,
``plugins``, ``use_distributed_sampler``) and checkpoints (``enable_checkpointing``,
``default_root_dir``). A value that asks for what raytrain does anyway (Lightning's default,
as ``--print_config`` writes it) is accepted and dropped.
"""

from __future__ import annotations

import zlib
from typing import Any

from raytrain.spec.fields import MAX_SEED

# Lightning 2.6's Trainer arguments (tests/unit/test_spec_lightning_cli.py pins the list
# against the installed Trainer's signature).
TRAINER_ARGUMENTS = frozenset(
    {
        "accelerator",
        "strategy",
        "devices",
        "num_nodes",
        "precision",
        "logger",
        "callbacks",
        "fast_dev_run",
        "max_epochs",
        "min_epochs",
        "max_steps",
        "min_steps",
        "max_time",
        "limit_train_batches",
        "limit_val_batches",
        "limit_test_batches",
        "limit_predict_batches",
        "overfit_batches",
        "val_check_interval",
        "check_val_every_n_epoch",
        "num_sanity_val_steps",
        "log_every_n_steps",
        "enable_checkpointing",
        "enable_progress_bar",
        "enable_model_summary",
        "accumulate_grad_batches",
        "gradient_clip_val",
        "gradient_clip_algorithm",
        "deterministic",
        "benchmark",
        "inference_mode",
        "use_distributed_sampler",
        "profiler",
        "detect_anomaly",
        "barebones",
        "plugins",
        "sync_batchnorm",
        "reload_dataloaders_every_n_epochs",
        "default_root_dir",
        "enable_autolog_hparams",
        "model_registry",
    }
)

# Trainer arguments raytrain sets itself: the values that ask for what it does anyway, and
# the field to use for anything else.
OWNED_TRAINER_ARGUMENTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "strategy": ((None, "auto"), "strategy.name (ddp or fsdp)"),
    "devices": ((None, "auto", -1), "scaling.num_workers (one worker per GPU or CPU slot)"),
    "num_nodes": ((None, 1), "scaling.num_workers (the workers over all nodes)"),
    "plugins": ((None, []), "trainer.precision and strategy.*"),
    "enable_checkpointing": ((None, True), "checkpoint.* (raytrain owns checkpoints)"),
    "default_root_dir": ((None,), "checkpoint.storage"),
    "use_distributed_sampler": ((None, True), "data (raytrain shards every dataset itself)"),
}
# accelerator → scaling.use_gpu
ACCELERATORS: dict[Any, bool | str] = {
    None: "auto",
    "auto": "auto",
    "cpu": False,
    "gpu": True,
    "cuda": True,
}
STRATEGIES = ("ddp", "fsdp")


def name_seed(name: str) -> int:
    """The seed of ``seed_everything: true``: drawn from the run's name, so that each run
    has its own and every attempt of one run the same (a resume continues its RNGs)."""
    return zlib.crc32(name.encode()) % (MAX_SEED + 1)


def lightning_cli_tree(tree: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``tree`` with LightningCLI's keys that raytrain holds elsewhere moved there:
    ``seed_everything`` → ``trainer.seed``, ``trainer.accelerator`` → ``scaling.use_gpu``,
    ``trainer.strategy: ddp|fsdp`` → ``strategy.name``; owned Trainer arguments at a value
    raytrain uses anyway dropped. Returns the new tree and a problem line per key it could
    not take, naming the key and the field to use. ``tree`` is not changed."""
    out = dict(tree)
    problems: list[str] = []
    trainer = out.get("trainer")
    trainer = dict(trainer) if isinstance(trainer, dict) else None
    if "seed_everything" in out:
        seed = out.pop("seed_everything")
        if trainer is not None and "seed" in trainer:
            problems.append("seed_everything: trainer.seed is set too; give one of them")
        elif seed is True:
            seed = name_seed(str(out.get("name", "")))
        out["trainer"] = trainer = {**(trainer or {}), "seed": None if seed is False else seed}
    if trainer is None:
        return out, problems

    def move(key: str, section: str, field: str, value: Any) -> None:
        current = out.get(section)
        current = dict(current) if isinstance(current, dict) else {}
        if field in current and current[field] != value:
            problems.append(
                f"trainer.{key}: {section}.{field} is set too, to "
                f"{current[field]!r}; give one of them"
            )
        current[field] = value
        out[section] = current

    if "accelerator" in trainer:
        accelerator = trainer.pop("accelerator")
        if accelerator not in ACCELERATORS:
            problems.append(
                f"trainer.accelerator: {accelerator!r} is not auto, cpu or gpu; "
                "raytrain places workers by scaling.use_gpu"
            )
        elif accelerator not in (None, "auto"):
            move("accelerator", "scaling", "use_gpu", ACCELERATORS[accelerator])
    if trainer.get("strategy") in STRATEGIES:
        move("strategy", "strategy", "name", trainer.pop("strategy"))
    for key, (accepted, instead) in OWNED_TRAINER_ARGUMENTS.items():
        if key not in trainer:
            continue
        value = trainer.pop(key)
        if value not in accepted:
            problems.append(f"trainer.{key}: raytrain sets this itself; use {instead}")
    out["trainer"] = trainer
    return out, problems
