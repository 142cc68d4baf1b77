"""The global batch of a run whose worker count changes: ``scaling.keep_global_batch``.

A global batch (the samples one optimizer step trains on) is ``data.batch_size`` x workers x
``trainer.accumulate_grad_batches``. An elastic run keeps each worker's batch, so without
this its global batch follows the worker count, and the loss curve changes under the user
at every resize. With it, the run's target is the global batch at its most workers, and on
fewer workers gradients are accumulated over more batches to make it up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrain.spec.data import DataSpec

if TYPE_CHECKING:
    from raytrain.spec.sections import JobSpec


@dataclass(frozen=True)
class GlobalBatch:
    """One worker count's batching: each worker's batch (None: the user's loaders set it),
    how many batches a step accumulates, and the global batch they make; ``target`` is
    what ``scaling.keep_global_batch`` asked for, in worker batches."""

    batch_size: int | None
    world_size: int
    accumulate: int
    target: int

    @property
    def batches(self) -> int:
        """Worker batches one optimizer step trains on (an epoch's last step may hold
        fewer rows)."""
        return self.world_size * self.accumulate

    @property
    def samples(self) -> int | None:
        """The rows of one optimizer step, where raytrain knows the batch size."""
        return None if self.batch_size is None else self.batch_size * self.batches

    @property
    def exact(self) -> bool:
        return self.batches == self.target

    def describe(self) -> str:
        workers = f"{self.world_size} worker{'s' if self.world_size != 1 else ''}"
        batch = f"batch {self.batch_size}" if self.batch_size is not None else "a loader's batch"
        size = self.samples if self.samples is not None else f"{self.batches} batches"
        line = f"global batch {size} ({workers} x {batch} x accumulate {self.accumulate})"
        if not self.exact:
            line += (
                f"; scaling.keep_global_batch keeps {self.target} worker batches a step "
                "where the worker count divides it: this is the nearest"
            )
        return line


def accumulation(target: int, world_size: int) -> int:
    """The batches a step accumulates so that ``world_size`` workers make a global batch
    nearest ``target`` worker batches: at least 1, and on a tie the smaller (fewer samples
    than asked rather than more). Exact whenever ``world_size`` divides ``target``."""
    low = max(1, target // world_size)
    return low if target - low * world_size <= (low + 1) * world_size - target else low + 1


def fewest_workers_batch(spec: JobSpec) -> GlobalBatch:
    """The batching on the fewest workers ``spec`` trains on: where
    ``scaling.keep_global_batch`` accumulates the most (the spec bounds it)."""

    return global_batch(spec, max(1, spec.scaling.min_workers // spec.strategy.replica_size))


def global_batch(spec: JobSpec, world_size: int) -> GlobalBatch:
    """The batching of ``spec`` on ``world_size`` workers (replicas, under tensor
    parallelism: ``worker.strategy.data_rank``). Without
    ``scaling.keep_global_batch`` it is the spec's accumulation, whatever the global batch;
    with it, the accumulation that keeps the global batch of ``scaling``'s most workers
    (``trainer.accumulate_grad_batches`` there)."""
    batch = spec.data.batch_size if isinstance(spec.data, DataSpec) else None
    accumulate = spec.trainer.accumulate_grad_batches
    if not spec.scaling.keep_global_batch:
        return GlobalBatch(batch, world_size, accumulate, world_size * accumulate)
    # the most replicas: a tensor-parallel group's (and a pipeline's) workers train one
    # replica's batch
    target = spec.scaling.max_workers // spec.strategy.replica_size * accumulate
    return GlobalBatch(batch, world_size, accumulation(target, world_size), target)
