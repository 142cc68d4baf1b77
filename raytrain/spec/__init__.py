"""The job spec: a typed, validated description of one training job.

A spec is YAML on disk and a pydantic model in code. Every section forbids unknown keys, so a
typo is an error rather than a silently ignored setting. Field names follow Lightning's
Trainer arguments and Ray's ScalingConfig/FailureConfig, so users of either recognise them.

``load_spec(path, overrides)`` reads the YAML, applies dotted command-line overrides
(``trainer.max_epochs=2``) and validates; every problem is collected into one ``SpecError``
whose lines each name a field path and what was expected.
"""

from raytrain.spec.fields import MAX_SPEC_DEPTH
from raytrain.spec.loading import apply_overrides, dump_spec, load_spec, parse_spec
from raytrain.spec.sections import (
    RESUMABLE_FIELDS,
    CheckpointSpec,
    DataSpec,
    FailureSpec,
    FsdpSpec,
    JobSpec,
    MlflowSpec,
    ModelSpec,
    ScalingSpec,
    ShuffleSpec,
    SourceSpec,
    StrategySpec,
    TrackingSpec,
    TrainerSpec,
    flatten,
)
from raytrain.spec.storage_options import AzureOptions, GcsOptions, S3Options, StorageSpec
from raytrain.spec.yaml_io import (
    MAX_OVERRIDE_PARTS,
    MAX_SPEC_BYTES,
    MAX_SPEC_NODES,
    load_yaml,
    read_spec_file,
)

__all__ = [
    "MAX_OVERRIDE_PARTS",
    "MAX_SPEC_BYTES",
    "MAX_SPEC_DEPTH",
    "MAX_SPEC_NODES",
    "RESUMABLE_FIELDS",
    "AzureOptions",
    "CheckpointSpec",
    "DataSpec",
    "FailureSpec",
    "FsdpSpec",
    "GcsOptions",
    "JobSpec",
    "MlflowSpec",
    "ModelSpec",
    "S3Options",
    "ScalingSpec",
    "ShuffleSpec",
    "SourceSpec",
    "StorageSpec",
    "StrategySpec",
    "TrackingSpec",
    "TrainerSpec",
    "apply_overrides",
    "dump_spec",
    "flatten",
    "load_spec",
    "load_yaml",
    "parse_spec",
    "read_spec_file",
]
