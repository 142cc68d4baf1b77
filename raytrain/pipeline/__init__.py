"""Pipeline parallelism inside Lightning's loop (``strategy.model_parallel.
pipeline_parallel_size`` > 1): the model cut into stages (``split``), each rank keeping
only its stage's modules (``stage``), and ``torch.distributed.pipelining``'s schedules run
as the training and validation steps (``runner``), the model's own steps computing each
micro-batch's loss on the last stage and what they log made known to every rank
(``relay``). ``docs/parallelism.md`` says when to use it; ``docs/decisions/066-*`` why it
is built this way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule
    from torch.distributed.device_mesh import DeviceMesh

    from raytrain.pipeline.runner import PipelineRunner
    from raytrain.spec.sections import ModelParallelSpec


@dataclass(frozen=True)
class Pipeline:
    """What the model-parallel strategy needs to run a pipeline (``_compat.model_parallel.
    PipelineParts``): the stage count, and ``build``, which cuts the model on the mesh."""

    stages: int
    schedule: str
    microbatches: int
    split_points: tuple[str, ...]

    @classmethod
    def of(cls, spec: ModelParallelSpec) -> Pipeline:
        stages = spec.pipeline_parallel_size
        options = spec.pipeline
        return cls(
            stages,
            options.schedule,
            options.microbatch_count(stages),
            tuple(options.split_points),
        )

    def build(self, module: LightningModule, mesh: DeviceMesh) -> PipelineRunner:
        """This rank's runner, the module cut to its stage (a collective over the
        pipeline)."""
        import sys

        from raytrain.pipeline.runner import PipelineRunner

        runner = PipelineRunner(
            module, mesh, self.schedule, self.microbatches, list(self.split_points)
        )
        held = runner.split()
        if mesh.get_rank() == 0:
            print(
                f"raytrain: pipeline of {self.stages} stages ({self.schedule}, "
                f"{self.microbatches} micro-batches); stage 0 holds {held}",
                file=sys.stderr,
                flush=True,
            )
        return runner
