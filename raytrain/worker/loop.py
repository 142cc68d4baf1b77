"""The training each Ray Train worker runs (``train``, entered through ``entry.train_loop``):
the driver's ``WorkerConfig`` back into objects, then ``fit``.

The worker builds the model, its shard's loaders, the strategy and callbacks, a Lightning
Trainer prepared for Ray, and restores from the run's latest committed checkpoint when
there is one.

Lightning is imported inside the functions: a warm worker process preloads this module
(``driver.warm_pool.PRELOAD``) and imports Lightning beside it.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raytrain.contract import Publish, Startup, WorkerConfig
from raytrain.spec import JobSpec

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import ray.train
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.profilers import Profiler
    from ray.actor import ActorHandle

    from raytrain.worker.hang_watchdog import HangWatchdog
    from raytrain.worker.memory_state import Restored
    from raytrain.worker.step_timeline import StepTimeline
    from raytrain.worker.threads import ThreadChoice


def _publisher(sink: Any, wait: bool = False) -> Publish | None:
    """What sends an event to the driver's sink (None: no sink), without waiting, or
    (``wait``) until the sink has it: a rank about to end its process would lose a send
    still under way."""
    import ray

    if sink is None:
        return None
    if wait:
        return lambda event: ray.get(sink.put.remote(event), timeout=30)
    return lambda event: sink.put.remote(event)


def _quiet_lightning() -> None:
    # One line per rank about GPUs/TPUs and tips help nobody reading a driver's output.
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*Total length of `.*` across ranks is zero.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")


def build_trainer(
    spec: JobSpec,
    callbacks: list[Callback],
    model: pl.LightningModule | None = None,
    loggers: list[Logger] | None = None,
    profiler: Profiler | None = None,
    accumulate: int | None = None,
) -> pl.Trainer:
    """A Lightning Trainer with the spec's options, prepared to run under Ray Train
    (``model``: what FSDP's module class names refer to; ``accumulate``: batches a step
    accumulates, default the spec's). The spec's other Trainer arguments
    (``trainer.passthrough``) are given as written."""
    import lightning.pytorch as pl

    from raytrain._compat.lightning import skip_sigterm_broadcast
    from raytrain.util.precision import decide
    from raytrain.worker.strategy import build_plugins, build_strategy, prepare

    t = spec.trainer
    precision, _ = decide(t.precision, spec.scaling.use_gpu is True)
    options: dict[str, Any] = {
        "num_sanity_val_steps": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **t.passthrough,
    }
    trainer = pl.Trainer(
        accelerator="gpu" if spec.scaling.use_gpu is True else "cpu",
        devices="auto",
        strategy=build_strategy(spec, model),
        plugins=build_plugins(spec),
        callbacks=callbacks,
        max_epochs=t.max_epochs,
        max_steps=t.max_steps,
        precision=precision,
        accumulate_grad_batches=accumulate or t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val,
        check_val_every_n_epoch=t.check_val_every_n_epoch,
        log_every_n_steps=t.log_every_n_steps,
        logger=loggers or False,
        enable_checkpointing=False,
        # raytrain samples every loader itself (data.loaders, worker.user_data)
        use_distributed_sampler=False,
        profiler=profiler,
        **options,
    )
    # SIGTERM is a preemption notice (raytrain.worker.preemption), agreed on about once a
    # second by PreemptionGuard; Lightning's own check is a collective before every batch.
    skip_sigterm_broadcast(trainer)
    return prepare(spec, trainer)


def train(config: dict[str, Any], entered: float) -> None:
    """Train the job of the ``WorkerConfig`` in ``config`` (see ``raytrain.contract``) on
    this worker; ``entered``: when ``entry.train_loop`` began, before these imports."""
    import ray.train

    from raytrain.checkpoints.layout import run_dir
    from raytrain.spec.global_batch import global_batch
    from raytrain.spec.lightning_config import instantiate
    from raytrain.worker.callbacks import build_callbacks  # imports Lightning
    from raytrain.worker.reporting import ReportLogger
    from raytrain.worker.strategy import data_rank
    from raytrain.worker.user_code import build_profiler, upload_profiles
    from raytrain.worker.user_data import worker_data

    startup = {"train_loop_entered": entered, "lightning_imported": time.time()}
    _quiet_lightning()
    work = WorkerConfig.from_train_loop_config(config)
    spec = work.spec
    context = ray.train.get_context()
    threads = _set_threads(spec)
    # the config's objects, built by LightningCLI's parser (nested class paths, links)
    user = instantiate(spec, logs_under=run_dir(spec))
    rank, world_size = context.get_world_rank(), context.get_world_size()
    # a tensor-parallel group's ranks read the same rows: data is sharded by replica
    replica, replicas = data_rank(spec, rank, world_size)
    data, loaders = worker_data(spec, work, user, replica, replicas)
    to_driver = _publisher(work.sink)  # every rank's timeline and hang report
    timeline, watchdog = _timers(work, to_driver, rank)
    batching = global_batch(spec, replicas)
    if rank == 0:  # at every start and resize: what one optimizer step trains on, and how
        print(f"raytrain: {batching.describe()}", flush=True)
        print(f"raytrain: {threads.describe()}", flush=True)
    checkpoint = ray.train.get_checkpoint()
    restored = _from_memory(work, rank, checkpoint)
    callbacks = build_callbacks(
        spec,
        data,
        to_driver if rank == 0 else None,  # rank 0's reports
        _startup(spec, startup),
        timeline,
        watchdog,
        batching,
        _rank0_readers(work, rank),
        user.callbacks,
        **_keeping(work, restored),
    )
    profiler, profiles = build_profiler(spec, rank)
    loggers = [ReportLogger(callbacks.reporter), *user.loggers]
    trainer = build_trainer(
        spec,
        _with_chaos(work, callbacks.ordered),
        user.model,
        loggers,
        profiler,
        accumulate=batching.accumulate,
    )
    _fit(trainer, user.model, loaders, spec, checkpoint, restored.checkpoint if restored else None)
    upload_profiles(spec, profiles)
    if rank == 0 and work.sink is not None:
        ray.get(work.sink.ping.remote())  # the driver has every event before the run ends


def _keeping(work: WorkerConfig, restored: Restored | None) -> dict[str, Any]:
    """``build_callbacks``' keeper arguments: the run's keeper with the token and key it
    was opened with, or none (no keeper, or one that could not be reached: this group
    keeps nothing in memory)."""
    if restored is None or restored.token is None:
        return {"keeper": None}
    return {"keeper": work.keeper, "keeper_token": restored.token, "keeper_key": restored.key}


def _startup(spec: JobSpec, marks: dict[str, float]) -> Startup:
    """What rank 0 reports once of its start (the reporter completes it): the wall-clock
    ``marks``, the process's own start before them, and the precision this worker decided
    on and why."""
    from raytrain.util.precision import decide

    precision = decide(spec.trainer.precision, spec.scaling.use_gpu is True)
    return Startup(
        marks={"worker_started": _process_started_at(marks["train_loop_entered"]), **marks},
        resumed_step=0,
        precision="{} ({})".format(*precision),
    )


def _with_chaos(work: WorkerConfig, ordered: list[Callback]) -> list[Callback]:
    """``failure.chaos``: the callbacks and, last, what tells the fault injector where this
    worker is and how far it got."""
    if work.chaos is None:
        return ordered
    import ray

    from raytrain.worker.chaos_marks import ChaosMarks

    return [*ordered, ChaosMarks(work.chaos, ray.get_runtime_context().get_node_id())]


def _set_threads(spec: JobSpec) -> ThreadChoice:
    """torch's intra-op threads as torchrun sets them (``worker.threads``), exported to this
    worker's own processes; the spec's seed set everywhere."""
    import torch

    from raytrain.worker.threads import OMP_ENV, choose_threads

    threads = choose_threads(spec.scaling.worker_resources().get("CPU", 1), os.environ)
    torch.set_num_threads(threads.threads)
    os.environ[OMP_ENV] = str(threads.threads)  # what its own processes inherit
    if spec.trainer.seed is not None:
        import lightning.pytorch as pl

        pl.seed_everything(spec.trainer.seed, workers=True, verbose=False)
    return threads


def _timers(
    work: WorkerConfig, to_driver: Publish | None, rank: int
) -> tuple[StepTimeline | None, HangWatchdog | None]:
    """This rank's step timeline (None: no sink, or ``tracking.timeline`` off) and hang
    watchdog (None: ``failure.hang`` off)."""
    import ray

    from raytrain.checkpoints.layout import run_dir
    from raytrain.worker.hang_watchdog import HangWatchdog
    from raytrain.worker.step_timeline import StepTimeline

    spec, node = work.spec, ray.util.get_node_ip_address()
    timeline = None
    if to_driver is not None and spec.tracking.timeline:
        timeline = StepTimeline(
            every_n_steps=spec.trainer.log_every_n_steps, publish=to_driver, rank=rank, node=node
        )
    limits = spec.failure.hang_limits()
    watchdog = None
    if limits.enabled:
        watchdog = HangWatchdog(
            limits=limits,
            run_dir=run_dir(spec),
            options=spec.storage,
            rank=rank,
            node=node,
            publish=_publisher(work.sink, wait=True),
        )
    return timeline, watchdog


def _from_memory(
    work: WorkerConfig, rank: int, checkpoint: ray.train.Checkpoint | None
) -> Restored | None:
    """``checkpoint.memory_every_n_steps``: what ``memory_state.restore_from_memory`` found
    (a state newer than ``checkpoint``, and the keeper's token: None when the keeper could
    not be reached, the same on every rank, and this group keeps nothing); None: no keeper."""
    if work.keeper is None:
        return None
    from raytrain.checkpoints.layout import run_dir
    from raytrain.checkpoints.node_slots import keep_scratch_name
    from raytrain.worker.memory_state import restore_from_memory

    return restore_from_memory(
        work.keeper,
        _checkpoint_step(checkpoint),
        _rollback_pending(work.spec, rank),
        keep_scratch_name(run_dir(work.spec)),
    )


def _fit(
    trainer: pl.Trainer,
    model: pl.LightningModule,
    loaders: dict[str, Any],
    spec: JobSpec,
    checkpoint: ray.train.Checkpoint | None,
    from_memory: str | None,
) -> None:
    """``trainer.fit``, from the newest state there is: one kept in memory (newer than
    ``checkpoint``), Ray Train's ``checkpoint``, or the spec's own start (a Lightning
    checkpoint of the user's, or none)."""
    from raytrain.checkpoints.layout import restore_path
    from raytrain.checkpoints.safe_load import lightning_globals, verify_checkpoint
    from raytrain.worker.user_code import start_from

    if from_memory is not None:  # the same content as a checkpoint's, newer
        try:
            with lightning_globals():
                trainer.fit(model, **loaders, ckpt_path=from_memory, weights_only=True)
        finally:
            shutil.rmtree(os.path.dirname(from_memory), ignore_errors=True)
    elif checkpoint is None:
        with lightning_globals():
            trainer.fit(model, **loaders, ckpt_path=start_from(spec), weights_only=True)
    else:
        with checkpoint.as_directory() as directory, lightning_globals():
            path = restore_path(directory)
            # Lightning reads FSDP checkpoints with unrestricted unpicklers (its own for a
            # full state dict, torch's DCP reader for shards): checked first. The rest it
            # reads with weights_only=True, whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says.
            verify_checkpoint(path)
            trainer.fit(model, **loaders, ckpt_path=path, weights_only=True)


def _rollback_pending(spec: JobSpec, rank: int) -> bool:
    """Rank 0: whether the run's last loss spike (``failure.spike``) has not been rolled
    back past yet (its rollback resumes from storage, never from the in-memory state)."""
    if rank != 0 or spec.failure.spike is None:
        return False
    from raytrain.checkpoints.layout import run_dir
    from raytrain.records.rollback_record import read_rollbacks

    past = read_rollbacks(run_dir(spec), spec.storage)
    return bool(past) and past[-1].restored_step is None


def _checkpoint_step(checkpoint: Any) -> int | None:
    """The step of the checkpoint Ray Train restores from (None: none), from its
    ``raytrain.json``, read alone; a step no state in memory is newer than where that
    cannot be read (the restore then uses the checkpoint)."""
    import json

    from raytrain.checkpoints.layout import META_FILE

    if checkpoint is None:
        return None
    try:
        with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/{META_FILE}") as handle:
            return int(json.loads(handle.read())["step"])
    except Exception:
        return sys.maxsize


def _sink_reader(
    sink: ActorHandle | None, method: str, default: object
) -> Callable[[], Any] | None:
    """What asks the driver's sink ``method()`` (None: no sink): its answer, or ``default``
    when it does not answer in 10 s (a sink restarted or slow: the next caller asks again).
    Rank 0 reads the run's mean time between failures (``mtbf``, for
    ``checkpoint.every_n_steps: auto``) and whether the driver asked the run to stop at a
    checkpoint (``preemption_requested``, for ``worker.preemption.watch_requests``)."""
    if sink is None:
        return None

    def read() -> Any:
        import ray

        try:
            return ray.get(getattr(sink, method).remote(), timeout=10)
        except Exception:
            return default

    return read


def _rank0_readers(work: WorkerConfig, rank: int) -> Callable[[], float | None] | None:
    """Rank 0 reads the driver's sink: whether the run was asked to stop at a checkpoint
    (set here, for ``worker.preemption``) and its MTBF (returned, for the checkpoint
    interval). The other ranks read nothing: the guards' all-reduces share rank 0's."""
    from raytrain.worker import preemption

    if rank != 0:
        preemption.watch_requests(None)
        return None
    preemption.watch_requests(_sink_reader(work.sink, "preemption_requested", False))
    return _sink_reader(work.sink, "mtbf", None)


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
