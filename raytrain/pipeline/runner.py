"""The pipeline's schedule as Lightning's training and validation steps.

Lightning keeps its loop (callbacks, logging, checkpoints, raytrain's reports); the
model-parallel strategy hands each step to ``PipelineRunner``, whose schedule
(``torch.distributed.pipelining``'s GPipe or 1F1B) runs forward and backward over the
micro-batches, the model's own step giving it its input and loss (``model_steps``). Every
rank of a pipeline reads the same batch (``worker.strategy.data_rank``). The loss (the
micro-batches' mean: the whole batch's, as without a pipeline) and what the step logged
(``relay``) then go from the last stage to the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from raytrain.pipeline.grads import HeldGrads, SharedParams
from raytrain.pipeline.model_steps import ModelSteps, rows_of
from raytrain.pipeline.relay import LogRelay
from raytrain.pipeline.stage import keep_only, shard_stage, stage_module

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle


class PipelineRunner:
    """One rank's part of the pipeline: its stage, its schedules, the pipeline's group.

    ``split`` (at setup, before ``configure_model``) cuts the model to this rank's stage;
    ``step`` runs one training or validation batch through the schedule; ``apply_grads``
    (the strategy's backward) and ``sync_shared_grads`` (before the optimizer steps) see
    its gradients through."""

    def __init__(
        self,
        module: LightningModule,
        mesh: DeviceMesh,
        schedule: str,
        microbatches: int,
        split_points: list[str],
    ) -> None:
        self.module, self.mesh = module, mesh
        self.schedule, self.microbatches = schedule, microbatches
        self.split_points = split_points
        pipeline = mesh["pipeline"]
        self.group = pipeline.get_group()
        self.index, self.stages = pipeline.get_local_rank(), pipeline.size()
        self.first, self.last = self.index == 0, self.index == self.stages - 1
        self.stage: torch.nn.Module | None = None
        self.shared: SharedParams | None = None
        self.relay, self.steps, self.held = LogRelay(), ModelSteps(module), HeldGrads(module)
        self._schedules: dict[tuple[bool, int], Any] = {}

    def split(self) -> str:
        """Cut the model to this rank's stage (a collective over the pipeline: the stages
        tell each other the parameters they hold). Returns what the stage holds."""
        self.stage, described = stage_module(self.module, self.mesh, self.split_points)
        keep_only(self.module, self.stage)
        self.shared = SharedParams(self.module, self.group, self.index, self.stages)
        return described

    def shard(self) -> None:
        """FSDP2 on the stage over ``data_parallel``, for a model without its own
        ``configure_model``."""
        assert self.stage is not None
        shard_stage(self.stage, self.mesh)

    def clip_options(self) -> dict[str, Any]:
        """What gradient clipping by norm needs under a pipeline (``worker.grad_clip``):
        the parameters this stage counts, and the group the stages' norms are summed
        over."""
        assert self.shared is not None
        return {"counted": self.shared.counted, "across": self.group}

    def apply_grads(self, scale: float = 1.0) -> None:
        self.held.apply(scale)

    def sync_shared_grads(self) -> None:
        assert self.shared is not None
        self.shared.sync()

    def step(
        self,
        batch: Any,
        batch_idx: int,
        training: bool,
        step_fn: Callable[..., Any] | None = None,
    ) -> torch.Tensor:
        """One batch through the pipeline: forward and backward when ``training``, else
        forward only. Returns the batch's loss (the micro-batches' mean), on every rank.
        ``step_fn``: the step to run instead of the model's training or validation step
        (an evaluation of the model's own, e.g. a fixed probe)."""
        module = self.module
        if step_fn is None:
            step_fn = module.training_step if training else module.validation_step
        rows = rows_of(batch)
        probes = int(training and self.last and (training, rows) not in self._schedules)
        schedule = self._schedule(training, rows)
        losses: list[torch.Tensor] = []
        before = self.held.before() if training else []
        try:
            with self.relay.recording(module), self.steps.on(batch, batch_idx, step_fn, probes):
                args = self.steps.input(step_fn, batch, batch_idx) if self.first else ()
                run = schedule.step if training else schedule.eval
                if self.last:  # the outputs are the loss function's: not kept merged
                    run(*args, target=torch.arange(rows), losses=losses, return_outputs=False)
                else:
                    run(*args, return_outputs=False)
        finally:
            if training:
                self.held.after(before)
        loss = torch.zeros((), device=module.device)
        if losses:
            loss = torch.stack([x.detach().float() for x in losses]).mean().to(module.device)
        source = dist.get_global_rank(self.group, self.stages - 1)
        dist.broadcast(loss, src=source, group=self.group)
        means = [self.relay.take(rows)]  # the last stage's, sent to the others
        dist.broadcast_object_list(means, src=source, group=self.group)
        self.relay.publish(module, means[0])
        return loss

    def _schedule(self, training: bool, rows: int) -> PipelineScheduleSingle:
        """A schedule (and its ``PipelineStage``) for batches of ``rows`` rows, built
        once: a stage keeps the shapes it first saw, so every micro-batch must have the
        same rows (``microbatch_count``). 1F1B needs a micro-batch per stage; a batch
        cut into fewer runs GPipe's order."""
        key = (training, rows)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            assert self.stage is not None
            stage = PipelineStage(
                self.stage, self.index, self.stages, self.module.device, group=self.group
            )
            micro = microbatch_count(self.microbatches, rows)
            one_f_one_b = self.schedule == "1f1b" and micro >= self.stages
            kind = Schedule1F1B if one_f_one_b else ScheduleGPipe
            self._schedules[key] = kind(stage, n_microbatches=micro, loss_fn=self.steps.loss)
        return self._schedules[key]


def microbatch_count(asked: int, rows: int) -> int:
    """The micro-batches a batch of ``rows`` rows is cut into: the most, up to
    ``asked``, that divide it evenly (a stage receives every micro-batch into buffers of
    the first one's shape). A batch of a prime number of rows above ``asked`` (an epoch's
    last, partial batch) goes through whole, as one micro-batch.

    Invariant: the result divides ``rows``, and is ``asked`` whenever ``asked`` does."""
    return max(d for d in range(1, min(asked, rows) + 1) if rows % d == 0)
