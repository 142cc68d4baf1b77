"""The job spec: a typed, validated description of one training job.

A spec is YAML on disk and a pydantic model in code. Every section forbids unknown keys, so a
typo is an error rather than a silently ignored setting. Field names follow Lightning's
Trainer arguments and Ray's ScalingConfig/FailureConfig, so users of either recognise them.

``load_spec(path, overrides)`` reads the YAML, applies dotted command-line overrides
(``trainer.max_epochs=2``) and validates; every problem is collected into one ``SpecError``
whose lines each name a field path and what was expected.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from raytrain.errors import SpecError

DEFAULT_STORAGE = "runs"
_IMPORT_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
# A run's name and an MLflow experiment's name become folder names (the run's folder, the
# experiment's artifact folder): letters, digits, ``._-`` (and inner spaces in an
# experiment), no path separator, never ``..``.
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_EXPERIMENT = r"^[A-Za-z0-9][A-Za-z0-9 ._-]*$"
# The largest seed Lightning's seed_everything (numpy's RNG) accepts.
MAX_SEED = 2**32 - 1


class _Section(BaseModel):
    # No NaN or infinity in any float field: a number of workers' CPUs, a clip value or an
    # interval of NaN passes every comparison and fails later, inside the run.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_nul_no_stray_bool(cls, value: Any, info: ValidationInfo) -> Any:
        """Every field: no NUL character in any string (paths and URIs end there in C); and
        no boolean where the field takes none (pydantic would take ``true`` as 1)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _section_type(field.annotation) is not None:
            return value  # a section checks its own fields, naming them
        _refuse_nul(value)
        if field is not None and not _admits_bool(field.annotation):
            _refuse_bool(value)
        return value


def _refuse_nul(value: Any, depth: int = 0) -> None:
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("contains a NUL character (\\x00)")
    elif isinstance(value, Mapping) and depth < MAX_SPEC_DEPTH:
        for key, item in value.items():
            _refuse_nul(key, depth + 1)
            _refuse_nul(item, depth + 1)
    elif isinstance(value, list | tuple) and depth < MAX_SPEC_DEPTH:
        for item in value:
            _refuse_nul(item, depth + 1)


def _admits_bool(annotation: Any) -> bool:
    """Whether a field of this type may hold a boolean: it is ``bool`` or ``Any``
    somewhere."""
    if annotation is bool or annotation is Any:
        return True
    return any(_admits_bool(arg) for arg in getattr(annotation, "__args__", ()))


def _refuse_bool(value: Any, depth: int = 0) -> None:
    if isinstance(value, bool):
        raise ValueError("a boolean (true/false) is not a value of this field")
    if isinstance(value, Mapping) and depth < MAX_SPEC_DEPTH:
        for item in value.values():
            _refuse_bool(item, depth + 1)
    elif isinstance(value, list | tuple) and depth < MAX_SPEC_DEPTH:
        for item in value:
            _refuse_bool(item, depth + 1)


def _check_location(value: str) -> str:
    """A path or URI that can name a store (``storage.location_problem``): no host in a
    ``file://`` URI, no credentials in any URI."""
    from raytrain.storage import location_problem

    problem = location_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


class ModelSpec(_Section):
    class_path: str = Field(
        pattern=_IMPORT_PATH,
        description="The LightningModule to train, as `package.module:Class`.",
    )
    init_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the class's constructor."
    )


class SourceSpec(_Section):
    uri: str = Field(
        min_length=1, description="A file, or a folder/prefix of many files: path or URI."
    )

    @field_validator("uri")
    @classmethod
    def _location(cls, value: str) -> str:
        return _check_location(value)

    format: Literal["parquet", "csv", "json", "images"] = Field(
        default="parquet",
        description="The files' format; `images`: image files, decoded on Ray Data workers "
        "into an `image` column, with a `label` column when they sit in one folder per class.",
    )
    image_size: tuple[int, int] | None = Field(
        default=None, description="`images`: resize every image to [height, width]."
    )
    image_mode: str | None = Field(
        default=None, description="`images`: a Pillow mode to convert to (`RGB`, `L`, ...)."
    )

    @field_validator("image_size")
    @classmethod
    def _positive_size(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and min(value) < 1:
            raise ValueError(f"height and width must be >= 1, got {list(value)}")
        return value


class ShuffleSpec(_Section):
    seed: int = Field(default=0, description="Seed of the per-epoch shuffle of the train set.")
    buffer_size: int = Field(
        default=4096, ge=1, description="Rows held by each worker's local shuffle buffer."
    )


class DataSpec(_Section):
    train: SourceSpec = Field(description="The training set.")
    val: SourceSpec | None = Field(default=None, description="The validation set.")
    columns: list[str] | None = Field(
        default=None,
        min_length=1,
        description="Read only these columns (a projection); all when unset.",
    )
    batch_size: int = Field(default=64, ge=1, description="Rows per batch on each worker.")
    shuffle: ShuffleSpec | None = Field(
        default_factory=ShuffleSpec, description="Shuffle the train set each epoch; null: off."
    )
    preprocess: str | None = Field(
        default=None,
        pattern=_IMPORT_PATH,
        description="`module:function(batch) -> batch` over dicts of numpy arrays, run as a Ray "
        "Data `map_batches` step on CPU workers while the training actors train.",
    )
    cache: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Keep a split in the object store across epochs (`always`), stream it "
        "from storage every epoch (`never`), or `auto`: cache what fits the object-store "
        "budget unless it is images or preprocessed, which stream.",
    )
    prepare: str | None = Field(
        default=None,
        pattern=_IMPORT_PATH,
        description="`module:function(train_uri, val_uri)` that writes the data when the train "
        "set is missing (used by the bundled jobs to materialise their datasets).",
    )


class ScalingSpec(_Section):
    num_workers: StrictInt | tuple[StrictInt, StrictInt] = Field(
        default=2,
        description="Ray Train workers (one per GPU/slot), or [min, max]: elastic, as many as "
        "the cluster holds between the two; each keeps data.batch_size (the global batch "
        "grows and shrinks with the workers).",
    )
    resize_check_s: float = Field(
        default=60.0,
        ge=0,
        description="Elastic runs: how often a healthy run checks whether more workers fit "
        "(growing restarts the workers from the latest checkpoint).",
    )
    use_gpu: bool = Field(default=False, description="Give each worker one GPU.")
    resources_per_worker: dict[str, float] | None = Field(
        default=None, description="Ray resources per worker; default {CPU: 1} (+ GPU: 1)."
    )

    @field_validator("num_workers")
    @classmethod
    def _worker_range(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (value, value) if isinstance(value, int) else value
        if low < 1:
            raise ValueError(f"must be at least 1, got {low}")
        if high < low:
            raise ValueError(f"[min, max] needs max >= min, got [{low}, {high}]")
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

    def worker_resources(self) -> dict[str, float]:
        """The Ray resources one worker asks for."""
        resources = dict(self.resources_per_worker or {})
        resources.setdefault("CPU", 1.0)
        if self.use_gpu:
            resources.setdefault("GPU", 1.0)
        return resources


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


class StrategySpec(_Section):
    name: Literal["ddp", "fsdp"] = Field(default="ddp", description="Distributed strategy.")
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec, description="FSDP options (name: fsdp).")


Precision = Literal[
    "32-true", "32", "64-true", "64", "16-mixed", "16", "bf16-mixed", "bf16", "16-true", "bf16-true"
]


class TrainerSpec(_Section):
    max_epochs: int | None = Field(default=10, ge=1, description="Stop after this many epochs.")
    max_steps: int = Field(default=-1, ge=-1, description="Stop after this many steps; -1: off.")
    precision: Precision = Field(default="32-true", description="Lightning precision.")
    accumulate_grad_batches: int = Field(default=1, ge=1, description="Batches per step.")
    gradient_clip_val: float | None = Field(default=None, ge=0, description="Clip grad norm.")
    check_val_every_n_epoch: int = Field(default=1, ge=1, description="Validate every N epochs.")
    log_every_n_steps: int = Field(default=50, ge=1, description="Report metrics every N steps.")
    seed: int | None = Field(
        default=42,
        ge=0,
        le=MAX_SEED,
        description="Seed for model init and RNGs, 0 to 2**32-1; null: none.",
    )


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

    every_n_steps: int | None = Field(default=None, ge=1, description="Checkpoint every N steps.")
    every_n_epochs: int | None = Field(
        default=1, ge=1, description="Checkpoint every N epochs; null: only by steps."
    )
    keep: int | None = Field(default=3, ge=1, description="Checkpoints kept; null: all.")
    monitor: str | None = Field(default=None, description="Metric ranking checkpoints to keep.")
    mode: Literal["min", "max"] = Field(default="min", description="Best `monitor` is min/max.")
    upload: Literal["async", "sync"] = Field(
        default="async",
        description="`async`: training goes on while a checkpoint uploads (Ray commits it once "
        "complete); `sync`: training waits for each upload.",
    )


class FailureSpec(_Section):
    max_failures: int = Field(
        default=0, ge=-1, description="Worker-group restarts allowed; -1: unlimited."
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

    @field_validator("experiment")
    @classmethod
    def _no_dots(cls, value: str | None) -> str | None:
        return _no_parent(value)

    tags: dict[str, str] = Field(default_factory=dict, description="Extra tags on the run.")
    log_model: bool = Field(
        default=True,
        description="Log the trained model (the best checkpoint's weights) with mlflow.pytorch "
        "at the end, with a signature and input example from the model's example_input_array.",
    )
    register_as: str | None = Field(
        default=None,
        min_length=1,
        description="Register the logged model under this name in MLflow's model registry.",
    )


class TrackingSpec(_Section):
    mlflow: MlflowSpec = Field(default_factory=MlflowSpec, description="MLflow tracking.")


class _EndpointSection(_Section):
    """A store's options; its ``endpoint_url`` is checked to be a URL without credentials."""

    @field_validator("endpoint_url", check_fields=False)
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        return _check_endpoint(value)


class S3Options(_EndpointSection):
    endpoint_url: str | None = Field(
        default=None,
        description="An S3-compatible endpoint (MinIO, Ceph, a test server), e.g. "
        "`http://127.0.0.1:9000`; default: `AWS_ENDPOINT_URL_S3`/`AWS_ENDPOINT_URL`, else AWS.",
    )
    region: str | None = Field(
        default=None,
        description="The buckets' region; default: `AWS_REGION`/`AWS_DEFAULT_REGION`, else "
        "looked up from the bucket.",
    )


class GcsOptions(_EndpointSection):
    endpoint_url: str | None = Field(
        default=None,
        description="A GCS-compatible endpoint (an emulator), e.g. `http://127.0.0.1:4443`; "
        "default: `STORAGE_EMULATOR_HOST`, else Google Cloud Storage.",
    )
    project_id: str | None = Field(default=None, description="Project that new buckets go to.")


class AzureOptions(_EndpointSection):
    account_name: str | None = Field(
        default=None,
        description="The storage account; default: the URI's `container@account...` part, "
        "else `AZURE_STORAGE_ACCOUNT_NAME`.",
    )
    endpoint_url: str | None = Field(
        default=None,
        description="A Blob endpoint other than Azure's (Azurite), e.g. `http://127.0.0.1:10000`;"
        " default: from `AZURE_STORAGE_CONNECTION_STRING`, else Azure.",
    )


_CREDENTIALS_REFUSED = "credentials do not belong in the spec"


def _no_parent(value: Any) -> Any:
    """A name that becomes a folder name holds no ``..`` (a path out of its parent)."""
    if isinstance(value, str) and ".." in value:
        raise ValueError("must not contain '..' (it becomes a folder name)")
    return value


def _check_endpoint(value: str | None) -> str | None:
    """An endpoint is ``http(s)://host[:port]``, and never carries credentials."""
    if value is None:
        return value
    from urllib.parse import urlparse

    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"expected http(s)://host[:port], got {value!r}")
    if parsed.username or parsed.password:
        raise ValueError(
            f"{_CREDENTIALS_REFUSED}: give them through the provider's standard chain "
            "(environment, profile, instance role)"
        )
    return value.rstrip("/")


class StorageSpec(_Section):
    """Where object stores are and how requests to them are retried. Credentials are never
    part of a spec: they come from each provider's standard chain."""

    s3: S3Options = Field(default_factory=S3Options, description="S3 and S3-compatible stores.")
    gcs: GcsOptions = Field(default_factory=GcsOptions, description="Google Cloud Storage.")
    azure: AzureOptions = Field(default_factory=AzureOptions, description="Azure Blob Storage.")
    max_attempts: int = Field(
        default=3,
        ge=1,
        le=20,
        description="Attempts per request: transient faults (connection errors, 5xx, "
        "throttling) are retried with exponential backoff; 403/404 are not.",
    )


class JobSpec(_Section):
    """One training job. ``name`` plus ``checkpoint.storage`` identify the run."""

    name: str = Field(
        pattern=_NAME,
        max_length=128,
        description="The run's identity (letters, digits, `._-`; no `/`, no `..`); the same "
        "name and storage resume the run.",
    )

    @field_validator("name")
    @classmethod
    def _no_dots(cls, value: str) -> str:
        return _no_parent(value)

    model: ModelSpec
    data: DataSpec
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    strategy: StrategySpec = Field(default_factory=StrategySpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    failure: FailureSpec = Field(default_factory=FailureSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)

    def flat(self) -> dict[str, Any]:
        """The spec as ``{"a.b.c": value}``, e.g. for MLflow params."""
        return flatten(self.model_dump(mode="json"))

    def digest(self) -> str:
        """A hash of what defines the run's results; fields a resume may change are left out."""
        flat = {k: v for k, v in self.flat().items() if not k.startswith(RESUMABLE_FIELDS)}
        return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:16]


# Fields that may change between attempts of one run without making it a different run:
# how long to train, how many workers, how failures and tracking are handled.
RESUMABLE_FIELDS = (
    "trainer.max_epochs",
    "trainer.max_steps",
    "trainer.log_every_n_steps",
    "scaling.",
    "failure.",
    "tracking.",
    "checkpoint.keep",
    "checkpoint.upload",
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


def apply_overrides(tree: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``tree`` with each ``a.b.c=value`` applied; values parse as YAML."""
    result = json.loads(json.dumps(tree)) if tree else {}
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            shown = item if len(item) <= 80 else f"{item[:80]}..."
            problems.append(f"override {shown!r}: expected KEY.PATH=VALUE")
            continue
        if key.count(".") >= MAX_OVERRIDE_PARTS:
            problems.append(f"override {key[:60]}...: {key.count('.') + 1} dotted parts, more "
                            f"than the limit of {MAX_OVERRIDE_PARTS}")  # fmt: skip
            continue
        try:
            value = load_yaml(raw, f"{key}: override value") if raw else ""
        except SpecError as exc:
            problems.extend(exc.problems)
            continue
        node = result
        *parents, leaf = key.split(".")
        for depth, part in enumerate(parents):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parents[: depth + 1])
                problems.append(f"{key}: cannot set inside {where}, which is not a section")
                break
            node = child
        else:
            node[leaf] = value
    if problems:
        raise SpecError(problems)
    return result


def _format_errors(error: ValidationError, model: type[BaseModel]) -> list[str]:
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(spec)"
        if item["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, item["loc"][:-1])
            hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
            lines.append(f"{path}: unknown field{hint}")
        elif item["type"] == "missing":
            lines.append(f"{path}: required field is missing")
        else:
            got = item.get("input")
            # a value refused for holding credentials is not echoed into a log
            secret = _CREDENTIALS_REFUSED in item["msg"]
            shown = "" if secret or isinstance(got, dict | list) else f", got {got!r}"
            lines.append(f"{path}: {item['msg']}{shown}")
    return lines


def _allowed_keys(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """The field names of the section at ``loc``, for 'unknown field' hints."""
    current: Any = model
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = _section_type(field.annotation)
        if current is None:
            return []
    return sorted(getattr(current, "model_fields", {}))


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _section_type(arg)
        if found is not None:
            return found
    return None


def parse_spec(tree: Any, source: str = "spec") -> JobSpec:
    """Validate a spec given as a mapping (e.g. from a pipeline) into a ``JobSpec``."""
    if not isinstance(tree, dict):
        raise SpecError(f"{source}: expected a mapping of sections, got {type(tree).__name__}")
    try:
        return JobSpec.model_validate(tree)
    except ValidationError as exc:
        raise SpecError(_format_errors(exc, JobSpec)) from None


def read_spec_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML spec file into a mapping; a missing, unreadable, oversized or malformed
    file is a ``SpecError`` naming it (see ``load_yaml`` for the limits)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(f"{path}: spec file not found") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a directory, expected a YAML spec file") from None
    except NotADirectoryError:
        raise SpecError(f"{path}: spec file not found (a part of the path is a file)") from None
    except (OSError, ValueError) as exc:  # permissions, a NUL in the path, ...
        reason = getattr(exc, "strerror", None) or str(exc)
        raise SpecError(f"{path!s}: cannot read the spec file: {reason}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(
            f"{path}: the spec file is larger than the limit of {MAX_SPEC_BYTES // 1024} KiB"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"{path}: the spec file is not UTF-8 text (byte {exc.start}: "
            f"{data[exc.start : exc.start + 1]!r})"
        ) from None
    tree = load_yaml(text.removeprefix("\ufeff"), path)
    if tree is None:
        raise SpecError(f"{path}: the spec file is empty")
    if not isinstance(tree, dict):
        raise SpecError(f"{path}: expected a mapping of sections, got {type(tree).__name__}")
    return tree


# Limits on what a spec may hold. A real spec is a few KiB and a few hundred nodes, nested a
# few levels; these refuse hostile input (an alias "bomb" that expands 1 KiB into 1e9 nodes,
# a 50 MB file, 5,000 levels of brackets) quickly, before it costs time or memory.
MAX_SPEC_BYTES = 1024 * 1024
MAX_SPEC_NODES = 100_000  # scalars, sequences and mappings, counting each alias's expansion
MAX_SPEC_DEPTH = 64  # nesting of sequences and mappings, through aliases too
MAX_OVERRIDE_PARTS = 32  # a.b.c=... : dotted parts of one override's key

_BaseLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built


class _DuplicateKey(yaml.MarkedYAMLError):
    pass


class _SpecLoader(_BaseLoader):
    """YAML's safe loader (libyaml's when present) that refuses a key given twice in one
    mapping: silently keeping the last one hides a mistake."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the constructor refuses it with its mark
                continue
            if first is not None:
                raise _DuplicateKey(
                    problem=f"duplicate key {key!r} (first at line {first})",
                    problem_mark=key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _check_size(text: str, source: str) -> Any:
    """Parse ``text`` to its node graph, refusing it (``SpecError`` naming ``source`` and the
    limit) when it nests deeper than ``MAX_SPEC_DEPTH`` or expands into more than
    ``MAX_SPEC_NODES`` nodes. The text's own nesting is counted from the event stream, which
    needs no recursion, before the graph is built; the expansion is counted over the graph
    once per distinct node, so an alias bomb costs its size, not its expansion."""
    depth = 0
    for event in yaml.parse(text, Loader=_BaseLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_SPEC_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark else "?"
                raise SpecError(f"{source}: nested deeper than the limit of {MAX_SPEC_DEPTH} "
                                f"levels (at line {line})")  # fmt: skip
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    loader = _SpecLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return loader, None
        sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, depth)
        stack: list[tuple[Any, bool]] = [(root, False)]
        busy: set[int] = set()
        while stack:
            node, children_done = stack.pop()
            if id(node) in sizes:
                continue
            kids = _children(node)
            if not children_done:
                if id(node) in busy:
                    raise SpecError(f"{source}: a recursive alias (a node that contains "
                                    "itself) is not allowed")  # fmt: skip
                busy.add(id(node))
                stack.append((node, True))
                stack.extend((kid, False) for kid in kids if id(kid) not in sizes)
                continue
            for kid in kids:
                if id(kid) not in sizes:  # reached only through a cycle
                    raise SpecError(f"{source}: a recursive alias (a node that contains "
                                    "itself) is not allowed")  # fmt: skip
            count = 1 + sum(sizes[id(kid)][0] for kid in kids)
            deep = 1 + max((sizes[id(kid)][1] for kid in kids), default=0)
            if count > MAX_SPEC_NODES:
                raise SpecError(f"{source}: expands into more than the limit of "
                                f"{MAX_SPEC_NODES:,} YAML nodes (aliases count each time "
                                "they are used)")  # fmt: skip
            if deep > MAX_SPEC_DEPTH + 1:
                raise SpecError(f"{source}: nested deeper than the limit of {MAX_SPEC_DEPTH} "
                                "levels (through aliases)")  # fmt: skip
            sizes[id(node)] = (count, deep)
            busy.discard(id(node))
        return loader, root
    except BaseException:
        loader.dispose()
        raise


def _children(node: Any) -> list[Any]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def load_yaml(text: str, source: str) -> Any:
    """Parse the YAML ``text`` of a spec (or an override's value) with the safe loader,
    within the limits above; any problem is a one-line ``SpecError`` naming ``source``."""
    try:
        loader, root = _check_size(text, source)
        try:
            return None if root is None else loader.construct_document(root)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        problem = " ".join((f"{context}, {problem}" if context else str(problem)).split())
        raise SpecError(f"{source}: malformed YAML{where}: {problem}") from None
    except RecursionError:
        raise SpecError(f"{source}: nested too deeply to read") from None


def load_spec(
    spec: str | os.PathLike[str] | Mapping[str, Any] | JobSpec,
    overrides: Iterable[str] = (),
) -> JobSpec:
    """Load a spec from a YAML path, a mapping or a ``JobSpec``, apply overrides, validate."""
    overrides = list(overrides)
    if isinstance(spec, JobSpec):
        if not overrides:
            return spec
        tree, source = spec.model_dump(mode="json"), "spec"
    elif isinstance(spec, Mapping):
        tree, source = dict(spec), "spec"
    else:
        source = os.fspath(spec)
        tree = read_spec_file(source)
    return parse_spec(apply_overrides(tree, overrides), source)


def dump_spec(spec: JobSpec) -> str:
    """The resolved spec as YAML, defaults filled in."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
