"""The job spec: a typed, validated description of one training job.

A spec is YAML on disk and a pydantic model in code. Every section forbids unknown keys, so a
typo is an error rather than a silently ignored setting (``trainer`` also takes any argument
of Lightning's Trainer, checked by name). A LightningCLI ``fit`` config is a spec too
(``lightning_cli``). Field names follow Lightning's
Trainer arguments and Ray's ScalingConfig/FailureConfig, so users of either recognise them.

``load_spec(path, overrides)`` reads the YAML, applies dotted command-line overrides
(``trainer.max_epochs=2``) and validates; every problem is collected into one ``SpecError``
whose lines each name a field path and what was expected.
"""

from raytrain.spec.classes import (
    CallbackSpec,
    ClassSpec,
    LoggerSpec,
    OptimizerSpec,
    SchedulerSpec,
    normalize_class_path,
)
from raytrain.spec.data import DataModuleSpec, DataSpec, MixSourceSpec, ShuffleSpec, SourceSpec
from raytrain.spec.fields import MAX_ACCUMULATION, MAX_SPEC_DEPTH
from raytrain.spec.loading import apply_overrides, dump_spec, load_spec, parse_spec
from raytrain.spec.sections import (
    RESUMABLE_FIELDS,
    CheckpointSpec,
    DdpSpec,
    FailureSpec,
    FsdpSpec,
    JobSpec,
    MlflowSpec,
    ModelParallelSpec,
    ModelSpec,
    PipelineSpec,
    PowerSgdSpec,
    ScalingSpec,
    SpikeSpec,
    StrategySpec,
    TrackingSpec,
    flatten,
)
from raytrain.spec.storage_options import AzureOptions, GcsOptions, S3Options, StorageSpec
from raytrain.spec.trainer import TrainerSpec
from raytrain.spec.yaml_io import (
    MAX_OVERRIDE_PARTS,
    MAX_SPEC_BYTES,
    MAX_SPEC_NODES,
    load_yaml,
    read_spec_file,
)

__all__ = [
    "MAX_ACCUMULATION",
    "MAX_OVERRIDE_PARTS",
    "MAX_SPEC_BYTES",
    "MAX_SPEC_DEPTH",
    "MAX_SPEC_NODES",
    "RESUMABLE_FIELDS",
    "AzureOptions",
    "CallbackSpec",
    "CheckpointSpec",
    "ClassSpec",
    "DataModuleSpec",
    "DataSpec",
    "DdpSpec",
    "FailureSpec",
    "FsdpSpec",
    "GcsOptions",
    "JobSpec",
    "LoggerSpec",
    "MixSourceSpec",
    "MlflowSpec",
    "ModelParallelSpec",
    "ModelSpec",
    "OptimizerSpec",
    "PipelineSpec",
    "PowerSgdSpec",
    "S3Options",
    "ScalingSpec",
    "SchedulerSpec",
    "ShuffleSpec",
    "SourceSpec",
    "SpikeSpec",
    "StorageSpec",
    "StrategySpec",
    "TrackingSpec",
    "TrainerSpec",
    "apply_overrides",
    "dump_spec",
    "flatten",
    "load_spec",
    "load_yaml",
    "normalize_class_path",
    "parse_spec",
    "read_spec_file",
]
