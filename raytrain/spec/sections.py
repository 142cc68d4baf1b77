"""The spec's sections as pydantic models, and ``JobSpec``, the whole job.

Every field has a description and a type; every section forbids unknown keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    StrictInt,
    field_validator,
    model_validator,
)

from raytrain.spec.classes import ClassSpec, OptimizerSpec, SchedulerSpec
from raytrain.spec.data import Data, DataSpec
from raytrain.spec.fields import (
    _EXPERIMENT,
    _NAME,
    DEFAULT_STORAGE,
    MAX_ACCUMULATION,
    MAX_SEED,
    _check_location,
    _Section,
    check_name,
    field_problem,
)
from raytrain.spec.global_batch import fewest_workers_batch
from raytrain.spec.model_checkpoint import as_written
from raytrain.spec.storage_options import StorageSpec
from raytrain.spec.trainer import TrainerSpec
from raytrain.spec.tune import TuneSpec


class ModelSpec(ClassSpec):
    """The LightningModule to train (`package.module.Class` or `package.module:Class`)."""


# The most workers a run may ask for: one Ray actor and process-group rank each, all
# coordinated by one driver; more is a typo (an elastic [1, 1e9]), not a cluster.
MAX_WORKERS = 10_000


@dataclass(frozen=True)
class HangLimits:
    """``failure``'s hang settings: ``timeout_s`` None is automatic, 0 is off."""

    timeout_s: float | None
    first_step_s: float
    checkpoint_s: float

    @property
    def enabled(self) -> bool:
        return self.timeout_s != 0


class ScalingSpec(_Section):
    num_workers: StrictInt | tuple[StrictInt, StrictInt] = Field(
        default=2,
        description="Ray Train workers (one per GPU/slot), or [min, max]: elastic, as many as "
        "the cluster holds between the two; each keeps data.batch_size (the global batch "
        f"grows and shrinks with the workers, unless keep_global_batch). At most {MAX_WORKERS}.",
    )
    resize_check_s: float = Field(
        default=60.0,
        ge=0,
        description="Elastic runs: how often a healthy run checks whether more workers fit "
        "(growing restarts the workers from the latest checkpoint).",
    )
    use_gpu: bool | Literal["auto"] = Field(
        default="auto",
        description="Give each worker one GPU; `auto`: when the cluster has a GPU for every "
        "worker, else CPU slots (the log says which).",
    )
    resources_per_worker: dict[str, float] | None = Field(
        default=None, description="Ray resources per worker; default {CPU: 1} (+ GPU: 1)."
    )
    keep_global_batch: bool = Field(
        default=False,
        description="Elastic runs: keep the global batch of the most workers when there are "
        "fewer, by accumulating gradients over more batches (trainer.accumulate_grad_batches "
        "x max / workers, rounded to the nearest where it does not divide; the log and the "
        "`global_batch` metric say what each worker count trains). On the fewest workers "
        f"that is at most {MAX_ACCUMULATION} batches a step.",
    )

    @field_validator("num_workers")
    @classmethod
    def _worker_range(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (value, value) if isinstance(value, int) else value
        if low < 1:
            raise ValueError(f"must be at least 1, got {low}")
        if high < low:
            raise ValueError(f"[min, max] needs max >= min, got [{low}, {high}]")
        if high > MAX_WORKERS:
            raise ValueError(
                f"{high} workers: more than the limit of {MAX_WORKERS} (one "
                "Ray actor and process-group rank each, one driver)"
            )
        return value

    @property
    def elastic(self) -> bool:
        """Whether the worker count is a range."""
        return not isinstance(self.num_workers, int)

    @property
    def min_workers(self) -> int:
        """The fewest workers the run trains on."""
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        """The most workers the run trains on."""
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]

    @field_validator("resources_per_worker")
    @classmethod
    def _non_negative(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, amount in (value or {}).items():
            if amount < 0:
                raise ValueError(f"{key} must be >= 0, got {amount}")
        return value

    def with_cluster_gpus(self, gpus: float) -> tuple[ScalingSpec, str | None]:
        """``use_gpu: auto`` decided for a cluster of ``gpus`` GPUs: GPUs when there is one
        for each of the fewest workers, else CPU slots; with what to log. Pure."""
        if self.use_gpu != "auto":
            return self, None
        use = gpus >= self.min_workers
        why = (
            f"{gpus:g} GPUs in the cluster: one per worker"
            if use
            else f"{gpus:g} GPUs in the cluster, {self.min_workers} workers: CPU slots"
        )
        return self.model_copy(update={"use_gpu": use}), f"scaling.use_gpu: auto: {why}"

    def worker_resources(self) -> dict[str, float]:
        """The Ray resources one worker asks for."""
        resources = dict(self.resources_per_worker or {})
        resources.setdefault("CPU", 1.0)
        if self.use_gpu is True:
            resources.setdefault("GPU", 1.0)
        return resources


class PowerSgdSpec(_Section):
    rank: StrictInt = Field(
        default=1,
        ge=1,
        description="The rank of the low-rank approximation each gradient matrix is sent as "
        "(PowerSGD's matrix_approximation_rank): an n x m gradient goes as (n + m) x rank "
        "numbers. Higher: closer to the plain gradient, less compression.",
    )
    start_iter: StrictInt = Field(
        default=10,
        ge=2,
        description="Steps of plain all-reduce before compressing (start_powerSGD_iter; at "
        "least 2, as error feedback needs): the first steps are the most sensitive to "
        "inexact gradients.",
    )


class DdpSpec(_Section):
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        default="none",
        description="Gradient compression between workers (a DDP communication hook, "
        "registered by raytrain on CPU and GPU alike): none (fp32 all-reduce), fp16 or bf16 "
        "(gradients sent at half the bytes, summed, cast back), powersgd (each gradient "
        "matrix sent as a low-rank approximation, its error fed back into the next step). "
        "It pays on slow links and large models; 2 ranks on one machine gain nothing.",
    )
    powersgd: PowerSgdSpec = Field(
        default_factory=PowerSgdSpec,
        description="PowerSGD's options (comm_hook: powersgd).",
    )


class FsdpSpec(_Section):
    sharding: Literal["full", "grad_op", "no_shard", "hybrid"] = Field(
        default="full",
        description="What is sharded across workers: full (parameters, gradients, optimizer "
        "state), grad_op (gradients and optimizer state), no_shard (DDP-like), hybrid (full "
        "within a node, replicated across nodes).",
    )
    auto_wrap: list[str] = Field(
        default_factory=list,
        description="Module class names (or package.module:Class) each wrapped as its own "
        "FSDP unit, e.g. a transformer block; empty: the whole model is one unit.",
    )
    activation_checkpointing: list[str] = Field(
        default_factory=list,
        description="Module class names whose activations are recomputed in the backward "
        "pass instead of kept (less memory, more compute).",
    )
    cpu_offload: bool = Field(default=False, description="Keep parameters on the CPU.")
    state_dict: Literal["sharded", "full"] = Field(
        default="sharded",
        description="Checkpoints: sharded (each worker writes its own shard, torch "
        "distributed checkpoint) or full (gathered on rank 0 into one file).",
    )


def _at_least_one_or_auto(value: int | str) -> int | str:
    """A count's check where ``auto`` is also allowed (pydantic's ``ge`` takes no union)."""
    if isinstance(value, int) and value < 1:
        raise ValueError(f"must be at least 1 or auto, got {value}")
    return value


class PipelineSpec(_Section):
    schedule: Literal["gpipe", "1f1b"] = Field(
        default="1f1b",
        description="The order a stage runs its micro-batches in (torch.distributed."
        "pipelining): gpipe (every forward, then every backward: activations of all "
        "micro-batches held at once) or 1f1b (one forward, one backward once the pipeline "
        "is full: at most pipeline_parallel_size micro-batches' activations held). Both "
        "leave the same bubble, (p - 1) / (m + p - 1) of a step.",
    )
    microbatches: StrictInt | Literal["auto"] = Field(
        default="auto",
        description="Micro-batches each batch is cut into (along its first dimension); at "
        "least pipeline_parallel_size. `auto`: 2 x pipeline_parallel_size. More shrink the "
        "bubble and each micro-batch's work.",
    )
    split_points: list[str] = Field(
        default_factory=list,
        description="Module paths of the model where a new stage begins, e.g. [blocks.2]: "
        "pipeline_parallel_size - 1 of them, in the order the model's forward calls them. "
        "The model's forward must pass one tensor from each child to the next; a model "
        "that defines pipeline_stages(mesh) splits itself and takes none. Empty and no "
        "hook: the model is cut into equal runs of the children its forward calls.",
    )

    @field_validator("microbatches")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        return _at_least_one_or_auto(value)

    def microbatch_count(self, stages: int) -> int:
        """The micro-batches per batch, ``auto`` resolved for ``stages`` stages."""
        return 2 * stages if self.microbatches == "auto" else self.microbatches


class ModelParallelSpec(_Section):
    data_parallel_size: StrictInt | Literal["auto"] = Field(
        default="auto",
        description="Workers in a data-parallel group (replicas, each FSDP2-sharded); "
        "`auto`: scaling.num_workers / (tensor_parallel_size x pipeline_parallel_size).",
    )
    tensor_parallel_size: StrictInt = Field(
        default=1,
        ge=1,
        description="Workers that split each layer between them (tensor parallelism, the "
        "model's configure_model plan); 1: FSDP2 alone. data_parallel_size x this must be "
        "scaling.num_workers.",
    )
    pipeline_parallel_size: StrictInt = Field(
        default=1,
        ge=1,
        description="Stages the model is cut into, each on its own workers, micro-batches "
        "flowing through them (pipeline parallelism, torch.distributed.pipelining); 1: no "
        "pipeline. data_parallel_size x tensor_parallel_size x this must be "
        "scaling.num_workers; the mesh is (pipeline, data_parallel, tensor_parallel).",
    )
    pipeline: PipelineSpec = Field(
        default_factory=PipelineSpec,
        description="How the stages run (pipeline_parallel_size > 1).",
    )

    @field_validator("data_parallel_size")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        return _at_least_one_or_auto(value)

    def sizes(self, world_size: int) -> tuple[int, int]:
        """(data-parallel, tensor-parallel) sizes for ``world_size`` workers, ``auto``
        resolved; assumes ``strategy_problems`` found none."""
        _, dp, tp = self.mesh_shape(world_size)
        return dp, tp

    def mesh_shape(self, world_size: int) -> tuple[int, int, int]:
        """(pipeline, data-parallel, tensor-parallel) sizes for ``world_size`` workers,
        ``auto`` resolved; assumes ``strategy_problems`` found none."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        dp = self.data_parallel_size
        return pp, world_size // (tp * pp) if dp == "auto" else dp, tp


class StrategySpec(_Section):
    name: Literal["ddp", "fsdp", "model_parallel"] = Field(
        default="ddp",
        description="Distributed strategy: ddp, fsdp (FSDP1, Lightning's FSDPStrategy) or "
        "model_parallel (Lightning's ModelParallelStrategy: the model's configure_model "
        "applies tensor parallelism and FSDP2 on a (data_parallel, tensor_parallel) mesh).",
    )
    ddp: DdpSpec = Field(default_factory=DdpSpec, description="DDP options (name: ddp).")
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec, description="FSDP options (name: fsdp).")
    model_parallel: ModelParallelSpec = Field(
        default_factory=ModelParallelSpec,
        description="Mesh sizes (name: model_parallel).",
    )

    @property
    def tensor_parallel_size(self) -> int:
        """Workers that split each layer between them (and read the same rows): 1 but
        under the model-parallel strategy."""
        return self.model_parallel.tensor_parallel_size if self.name == "model_parallel" else 1

    @property
    def pipeline_parallel_size(self) -> int:
        """Pipeline stages: 1 but under the model-parallel strategy."""
        return self.model_parallel.pipeline_parallel_size if self.name == "model_parallel" else 1

    @property
    def replica_size(self) -> int:
        """Workers that hold one model replica between them and so read the same rows:
        a tensor-parallel group times the pipeline's stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def needs_configure_model(self) -> bool:
        """Whether the strategy leaves sharding the model to its ``configure_model``: under
        model_parallel, but for a pipeline without tensor parallelism, whose stages raytrain
        shards itself (FSDP2 over data_parallel) when the model does not."""
        if self.name != "model_parallel":
            return False
        return self.pipeline_parallel_size == 1 or self.tensor_parallel_size > 1


class CheckpointSpec(_Section):
    storage: str = Field(
        default=DEFAULT_STORAGE,
        min_length=1,
        description="Where runs keep checkpoints and state: a local path or a URI.",
    )

    @field_validator("storage")
    @classmethod
    def _location(cls, value: str) -> str:
        return _check_location(value)

    every_n_steps: int | Literal["auto"] | None = Field(
        default=None,
        description="Checkpoint every N steps; `auto`: the interval that wastes least, "
        "sqrt(2 x a save's blocking time x the mean time between failures) over the step "
        "time (Young/Daly), from the run's own measurements, re-chosen at each checkpoint "
        "(the MTBF: measured from the run's failures, else failure.mtbf_s, else "
        "failure.chaos.mtbf_s, else a day).",
    )
    every_n_epochs: int | None = Field(
        default=1, ge=1, description="Checkpoint every N epochs; null: only by steps."
    )
    memory_every_n_steps: int | Literal["auto"] | None = Field(
        default="auto",
        description="Every N steps the training state (with the data position) is kept in "
        "memory outside the training processes, replacing the one before: under DDP rank 0 "
        "copies it into its node's memory (/dev/shm), which survives a process's loss, and "
        "less often sends it to a Ray actor the driver starts, which survives a node's; "
        "under FSDP and model_parallel every rank writes its shard (as a checkpoint does, to "
        "node-local memory) and each node's first rank sends its node's to that actor. A "
        "restart after a worker's or node's loss resumes from the newest copy when it is "
        "newer than the checkpoint in storage. `auto` (the default): every step where "
        "keeping it costs at most 5% of a step, else the smallest interval that does, from "
        "the run's own measurements (DDP: 4.5% for the node's copy, 0.5% for the actor's); "
        "a number: the node copy's interval (DDP), the actor's then chosen as under auto; "
        "`off` or null: storage only.",
    )
    keep: int | None = Field(default=3, ge=1, description="Checkpoints kept; null: all.")
    monitor: str | None = Field(default=None, description="Metric ranking checkpoints to keep.")
    mode: Literal["min", "max"] = Field(default="min", description="Best `monitor` is min/max.")
    upload: Literal["async", "sync"] = Field(
        default="async",
        description="`async`: training goes on while a checkpoint uploads (Ray commits it once "
        "complete); `sync`: training waits for each upload.",
    )

    @field_validator("every_n_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: Any) -> Any:
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("expected a number of steps (1 or more), auto, or null")
        return value

    @field_validator("memory_every_n_steps", mode="before")
    @classmethod
    def _memory_steps(cls, value: Any) -> Any:
        if value is False or value == "off":  # YAML reads a bare off as false
            return None
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**9:
            raise ValueError("expected a number of steps (1 to 1,000,000,000), auto, off, or null")
        return value


class SpikeSpec(_Section):
    threshold: float = Field(
        default=8.0,
        gt=0,
        allow_inf_nan=False,
        description="A batch's loss (the mean over the ranks) is a spike when it lies this "
        "many robust standard deviations (1.4826 x the median absolute deviation) above the "
        "median of the window.",
    )
    window: int = Field(
        default=100,
        ge=5,
        le=100_000,
        description="How many recent batch losses the score is taken against; no batch is "
        "judged before the window is full (kept in checkpoints, so a restore judges at once).",
    )
    max_rollbacks: int = Field(
        default=3,
        ge=0,
        description="Rollbacks allowed in the run; at the next spike it stops, naming it.",
    )


class ChaosSpec(_Section):
    mtbf_s: float = Field(
        gt=0,
        allow_inf_nan=False,
        description="Mean seconds of training between injected faults (each a SIGKILL of "
        "one worker, drawn at random), exponentially distributed.",
    )
    seed: int = Field(
        default=0, ge=0, le=MAX_SEED, description="The faults' seed: the same draws each time."
    )


class FailureSpec(_Section):
    max_failures: int = Field(
        default=0, ge=-1, description="Worker-group restarts allowed; -1: unlimited."
    )
    mtbf_s: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="The mean time between failures expected, in seconds, for "
        "checkpoint.every_n_steps: auto until the run measures its own; null: a day.",
    )
    max_preemptions: int = Field(
        default=-1,
        ge=-1,
        description="Restarts after a preemption (a SIGTERM to a worker, a node drained for "
        "preemption), counted apart from max_failures; -1: unlimited.",
    )
    preemption_check_s: float = Field(
        default=1.0,
        ge=0,
        description="How often, in seconds of training, the workers agree on whether a "
        "preemption notice came (one small all-reduce); 0: every step.",
    )
    hang_timeout_s: float | None = Field(
        default=None,
        ge=0,
        description="Seconds a rank may go without finishing a batch before it counts as "
        "hung: every rank's stacks go to the run's `hangs/` folder and MLflow, and the "
        "attempt fails (restarted under max_failures). Default: max(60, 20x the median "
        "step time); 0: off.",
    )
    hang_first_step_s: float = Field(
        default=600.0,
        gt=0,
        description="The allowance of a first batch: of training, of an epoch, of a "
        "validation (compiling, loaders starting).",
    )
    hang_checkpoint_s: float = Field(
        default=600.0,
        gt=0,
        description="The allowance of a batch's, validation's or epoch's end hooks, where "
        "checkpoints are saved.",
    )

    chaos: ChaosSpec | None = Field(
        default=None,
        description="Inject faults into this run (`raytrain run --chaos MTBF`), to see what "
        "they cost: workers SIGKILLed at random, retried without counting against "
        "max_failures; the summary and MLflow (`chaos/...`) give each fault's lost steps "
        "and recovery time, and the overhead; null: off.",
    )
    spike: SpikeSpec | None = Field(
        default=None,
        description="Roll back past a loss spike: the ranks agree on it, the run restarts from "
        "its last checkpoint before it and skips the rows of the steps up to and including "
        "the spiked batch (recorded in rollbacks.json and MLflow); null: off.",
    )

    def expected_mtbf(self) -> tuple[float | None, str]:
        """The MTBF ``checkpoint.every_n_steps: auto`` starts from, and where it came from:
        ``mtbf_s``, else the injected faults' mean (``chaos``: the user said faults come
        that often), else None (the interval's assumption)."""
        if self.mtbf_s is not None:
            return self.mtbf_s, "failure.mtbf_s"
        if self.chaos is not None:
            return self.chaos.mtbf_s, "failure.chaos.mtbf_s"
        return None, "assumed"

    def hang_limits(self) -> HangLimits:
        """The hang settings, for ``worker.hang_watchdog``."""
        return HangLimits(self.hang_timeout_s, self.hang_first_step_s, self.hang_checkpoint_s)


class MlflowSpec(_Section):
    tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI; default: $MLFLOW_TRACKING_URI, else mlflow.db in the "
        "current folder.",
    )
    experiment: str | None = Field(
        default=None,
        pattern=_EXPERIMENT,
        max_length=128,
        description="Experiment name (letters, digits, `._-`, inner spaces; no `/`, no `..`); "
        "default: `name`.",
    )

    @field_validator("experiment", "register_as")
    @classmethod
    def _shown_name(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, spaces=True)

    tags: dict[str, str] = Field(
        default_factory=dict,
        description="Extra tags on the run; each key letters, digits, `._-` (parts joined by "
        "`/`), no `..`.",
    )

    @field_validator("tags")
    @classmethod
    def _tag_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            check_name(key, key=True)
        return value

    log_model: bool = Field(
        default=True,
        description="Log the trained model (the best checkpoint's weights) with mlflow.pytorch "
        "at the end, with a signature and input example from the model's example_input_array.",
    )
    register_as: str | None = Field(
        default=None,
        min_length=1,
        description="Register the logged model under this name in MLflow's model registry "
        "(letters, digits, `._-`, inner spaces; no `/`, no `..`).",
    )


class TrackingSpec(_Section):
    mlflow: MlflowSpec = Field(default_factory=MlflowSpec, description="MLflow tracking.")
    timeline: bool = Field(
        default=True,
        description="Time every rank's steps by part (data wait, forward, backward, waiting "
        "in collectives, optimizer, hooks), p50/p90 per report window into "
        "MLflow, and name a straggler rank (bench/overhead.py measures its cost).",
    )
    prometheus: bool = Field(
        default=True,
        description="Set the run's step, throughput, loss, metrics, step-time parts, "
        "checkpoint stall, restarts and hangs as Ray metrics (ray.util.metrics), which a "
        "cluster's nodes serve to Prometheus (cluster/grafana/raytrain.json charts them).",
    )


class JobSpec(_Section):
    """One training job. ``name`` plus ``checkpoint.storage`` identify the run."""

    # Where a ModelCheckpoint read as ``checkpoint.*`` sat in the ``trainer.callbacks`` the
    # user wrote (``spec.model_checkpoint``), so the other entries' problems name the index
    # the user wrote, not their index in ``trainer.callbacks`` without it. Not a field.
    _callbacks_taken_from: int | None = PrivateAttr(default=None)

    def as_written(self, problem: str) -> str:
        """``problem`` with its ``trainer.callbacks.N`` numbered as in the user's config."""
        return as_written(problem, self._callbacks_taken_from)

    name: str = Field(
        pattern=_NAME,
        max_length=128,
        description="The run's identity (letters, digits, `._-`; no `/`, no `..`); the same "
        "name and storage resume the run.",
    )

    @field_validator("name")
    @classmethod
    def _name_rule(cls, value: str) -> str:
        return check_name(value)

    model: ModelSpec = Field(description="The LightningModule to train.")
    data: Data | None = Field(
        default=None,
        description="The data: file sources (`train`, `val`, ...), a LightningDataModule "
        "(`class_path`, `init_args`), or absent: the model's own dataloaders.",
    )
    scaling: ScalingSpec = Field(
        default_factory=ScalingSpec,
        description="How many Ray Train workers, on what resources, and elastic ranges.",
    )
    strategy: StrategySpec = Field(
        default_factory=StrategySpec,
        description="How the workers split the model: DDP, FSDP, or a model-parallel mesh.",
    )
    trainer: TrainerSpec = Field(
        default_factory=TrainerSpec,
        description="Lightning Trainer arguments: length, precision, accumulation, clipping.",
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec,
        description="Where and when checkpoints are written, kept and kept in memory.",
    )
    failure: FailureSpec = Field(
        default_factory=FailureSpec,
        description="Restarts, preemptions, hangs and loss spikes: what a fault costs.",
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec,
        description="MLflow, the step timeline and Prometheus gauges.",
    )
    storage: StorageSpec = Field(
        default_factory=StorageSpec,
        description="Object-store options (S3 endpoint and region, retries) for every URI.",
    )
    optimizer: OptimizerSpec | None = Field(
        default=None,
        description="LightningCLI's automatic optimizer: built over the model's parameters in "
        "place of its configure_optimizers.",
    )
    lr_scheduler: SchedulerSpec | None = Field(
        default=None,
        description="LightningCLI's automatic LR scheduler over `optimizer` (stepped each "
        "epoch; ReduceLROnPlateau's `monitor` names its metric).",
    )
    lightning_cli: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][\w.]*[:.][A-Za-z_]\w*$",
        description="A project's LightningCLI subclass (`package.module:MyCLI`) whose "
        "parser reads `model`, `data`, `optimizer`, `lr_scheduler` and `trainer.callbacks`/"
        "`logger`: its add_arguments_to_parser and link_arguments apply. Default: "
        "LightningCLI's own.",
    )
    ckpt_path: str | None = Field(
        default=None,
        min_length=1,
        description="A Lightning checkpoint (path or URI) a new run starts from; a run "
        "with checkpoints of its own resumes from those.",
    )

    tune: TuneSpec | None = Field(
        default=None,
        description="A sweep over this spec's fields, run by `raytrain tune` (`raytrain run` "
        "trains one spec and refuses it).",
    )

    @field_validator("ckpt_path")
    @classmethod
    def _ckpt_location(cls, value: str | None) -> str | None:
        return None if value is None else _check_location(value)

    @model_validator(mode="after")
    def _kept_batch_bounded(self) -> JobSpec:
        """``scaling.keep_global_batch`` accumulates max / min as many batches on the fewest
        workers of a range: bounded as ``trainer.accumulate_grad_batches`` is."""
        if not (self.scaling.keep_global_batch and self.scaling.elastic):
            return self
        batch = fewest_workers_batch(self)
        if batch.accumulate > MAX_ACCUMULATION:
            low, high = self.scaling.min_workers, self.scaling.max_workers
            raise field_problem(
                "scaling.num_workers",
                f"[{low}, {high}] with "
                f"scaling.keep_global_batch: {batch.describe()}, more than "
                f"the limit of {MAX_ACCUMULATION} batches a step: narrow the "
                "range or drop keep_global_batch",
            )
        return self

    @model_validator(mode="after")
    def _scheduler_needs_optimizer(self) -> JobSpec:
        if self.lr_scheduler is not None and self.optimizer is None:
            raise ValueError(
                "lr_scheduler needs optimizer (LightningCLI's automatic "
                "configure_optimizers builds both)"
            )
        return self

    @property
    def files(self) -> DataSpec | None:
        """The file sources, when `data` is files."""
        return self.data if isinstance(self.data, DataSpec) else None

    def flat(self) -> dict[str, Any]:
        """The spec as ``{"a.b.c": value}``, e.g. for MLflow params. A spec without a
        sweep has no ``tune`` key (its digest is what it was before sweeps existed)."""
        exclude = {"tune"} if self.tune is None else None
        return flatten(self.model_dump(mode="json", exclude=exclude))

    def digest(self) -> str:
        """A hash of what defines the run's results; fields a resume may change are left out."""
        flat = {k: v for k, v in self.flat().items() if not k.startswith(RESUMABLE_FIELDS)}
        return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:16]


# Fields that may change between attempts of one run without making it a different run:
# how long to train, how many workers, how failures and tracking are handled, what is
# profiled and logged besides MLflow, and where a run without checkpoints starts.
RESUMABLE_FIELDS = (
    "strategy.model_parallel.",  # the mesh: a checkpoint is resharded (DCP) on another
    "trainer.max_epochs",
    "trainer.max_steps",
    "trainer.log_every_n_steps",
    "trainer.profiler",
    "trainer.profile_all_ranks",
    "trainer.logger",
    "ckpt_path",
    "scaling.",
    "failure.",
    "tracking.",
    "checkpoint.keep",
    "checkpoint.upload",
    "checkpoint.memory_every_n_steps",  # how a failure is recovered, not what is trained
    "storage.",
)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into dotted keys; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out
