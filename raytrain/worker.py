"""The train loop each Ray Train worker runs: the spec back into objects, then ``fit``.

The worker receives only the validated spec (as a plain dict). It builds the model, its
shard's loaders, the strategy and callbacks, a Lightning Trainer prepared for Ray, and
restores from the run's latest committed checkpoint when there is one.

Lightning is imported inside the functions: the driver imports this module (Ray Train
pickles ``train_loop`` by reference) and should not pay for Lightning's import.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any

from raytrain.spec import JobSpec


def _quiet_lightning() -> None:
    # One line per rank about GPUs/TPUs and tips help nobody reading a driver's output.
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*Total length of `.*` across ranks is zero.*")


def build_trainer(spec: JobSpec, callbacks: list[Any], model: Any = None) -> Any:
    """A Lightning Trainer with the spec's options, prepared to run under Ray Train
    (``model``: what FSDP's module class names refer to)."""
    import lightning.pytorch as pl
    from ray.train.lightning import prepare_trainer

    from raytrain.strategy import build_plugins, build_strategy

    t = spec.trainer
    trainer = pl.Trainer(
        accelerator="gpu" if spec.scaling.use_gpu else "cpu",
        devices="auto",
        strategy=build_strategy(spec, model),
        plugins=build_plugins(spec),
        callbacks=callbacks,
        max_epochs=t.max_epochs,
        max_steps=t.max_steps,
        precision=t.precision,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val,
        check_val_every_n_epoch=t.check_val_every_n_epoch,
        log_every_n_steps=t.log_every_n_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    _skip_lightning_sigterm_check(trainer)
    return prepare_trainer(trainer)


def _skip_lightning_sigterm_check(trainer: Any) -> None:
    """Drop the collective Lightning runs before every batch to agree on a SIGTERM.

    Under DDP, Lightning broadcasts rank 0's "received SIGTERM" flag before every training
    batch: a collective (and a sync point) per step. Its flag is never set here: Lightning
    installs its handler only from the main thread, and Ray Train runs the train loop in
    another. SIGTERM is a preemption notice that ``raytrain.preemption`` records and
    ``guards.PreemptionGuard`` agrees on, about once a second of training.
    """
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: train the job in ``config["spec"]``."""
    entered = time.time()
    import ray.train
    import torch

    from raytrain.checkpoint import restore_path
    from raytrain.data import worker_loaders
    from raytrain.preflight import import_object
    from raytrain.report_callback import LoaderPosition, ReportCallback  # imports Lightning
    from raytrain.system_metrics import SystemMetrics

    imported = time.time()
    _quiet_lightning()
    spec = JobSpec.model_validate(config["spec"])
    context = ray.train.get_context()
    threads = max(1, int(spec.scaling.worker_resources().get("CPU", 1)))
    torch.set_num_threads(threads)
    if spec.trainer.seed is not None:
        import lightning.pytorch as pl

        pl.seed_everything(spec.trainer.seed, workers=True, verbose=False)

    model = import_object(spec.model.class_path)(**spec.model.init_args)
    train_loader, val_loader = worker_loaders(
        spec, config.get("cached", {}), context.get_world_rank(), context.get_world_size()
    )
    ckpt = spec.checkpoint
    sink = config.get("sink") if context.get_world_rank() == 0 else None
    # rank 0's loop, timed: it reports; it runs before ReportCallback, which samples it
    system = SystemMetrics() if sink is not None else None
    report = ReportCallback(
        every_n_steps=ckpt.every_n_steps,
        every_n_epochs=ckpt.every_n_epochs,
        log_every_n_steps=spec.trainer.log_every_n_steps,
        monitor=ckpt.monitor,
        mode=ckpt.mode,
        upload=ckpt.upload,
        sharded=spec.strategy.name == "fsdp" and spec.strategy.fsdp.state_dict == "sharded",
        publish=(lambda event: sink.put.remote(event)) if sink is not None else None,
        startup={
            "_worker_started_at": _process_started_at(entered),
            "_loop_entered_at": entered,
            "_lightning_imported_at": imported,
        },
        system=system,
    )
    from raytrain.guards import FiniteGuard, PreemptionGuard

    preemption = PreemptionGuard(report, spec.failure.preemption_check_s)  # after report
    timed = ([system], [system.end_marker()]) if system else ([], [])
    callbacks = [*timed[0], FiniteGuard(), report, preemption, LoaderPosition(train_loader),
                 *timed[1]]  # fmt: skip
    trainer = build_trainer(spec, callbacks, model)

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.fit(model, train_loader, val_loader)
    else:
        from raytrain.safe_load import lightning_globals, verify_checkpoint

        with checkpoint.as_directory() as directory, lightning_globals():
            path = restore_path(directory)
            # Lightning reads FSDP checkpoints with unrestricted unpicklers (its own for a
            # full state dict, torch's DCP reader for shards): checked first. The rest it
            # reads with weights_only=True, whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says.
            verify_checkpoint(path)
            trainer.fit(model, train_loader, val_loader, ckpt_path=path, weights_only=True)
    if sink is not None:
        ray.get(sink.ping.remote())  # the driver has every event before the run ends


def _process_started_at(default: float) -> float:
    """When this process started (wall clock), from /proc on Linux; else ``default``."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            ticks = int(handle.read().rpartition(")")[2].split()[19])
        with open("/proc/stat", encoding="ascii") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return default
