"""Checks against the world, before Ray starts or anything is written.

``spec.py`` validates a spec's shape; this module checks what it names: that the model class
imports and is a LightningModule, that the data exists with the columns the spec asks for,
and that the cluster can ever hold the workers. Every problem found is collected, so one run
shows the user all of them.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from raytrain import storage
from raytrain.driver import source_check
from raytrain.errors import SpecError
from raytrain.spec import JobSpec, StorageSpec
from raytrain.util.imports import OLD_NAMESPACE_HINT, import_object, old_namespace

if TYPE_CHECKING:
    import pyarrow as pa

    from raytrain.spec import DataSpec, SourceSpec


def check_model_located(spec: JobSpec) -> list[str]:
    """The model's module can be found and defines the class's name, read from its source
    without running it (``check_model`` imports it: Lightning and torch, seconds)."""
    problem = source_check.module_problem(spec.model.class_path)
    if problem:
        return [f"model.class_path: {problem}"]
    if source_check.binds(spec.model.class_path) is False:
        return check_model(spec)  # the source does not bind it: confirm by importing
    if spec.strategy.needs_configure_model:
        module, _, name = spec.model.class_path.partition(":")
        defined = source_check.defines_method(module, name, "configure_model")
        if defined is False:
            return [_NO_CONFIGURE_MODEL.format(path=spec.model.class_path)]
        if defined is None:  # a base the source cannot show: import the class to know
            return check_model(spec)
    return []


_NO_CONFIGURE_MODEL = (
    "model.class_path: {path} defines no configure_model, which strategy.name "
    "model_parallel needs: there the model shards itself on self.device_mesh, applying "
    "torch's parallelize_module over device_mesh['tensor_parallel'] and fully_shard (FSDP2) "
    "over device_mesh['data_parallel'] (raytrain.models.tinygpt:TinyGPT.configure_model is "
    "an example)"
)


def check_model(spec: JobSpec) -> list[str]:
    """The model class imports and is a LightningModule subclass."""
    path = spec.model.class_path
    try:
        cls = import_object(path)
    except ModuleNotFoundError as exc:
        return [f"model.class_path: cannot import {path!r}: {exc}"]
    except AttributeError:
        module = path.partition(":")[0]
        return [f"model.class_path: module {module!r} has no attribute {path.partition(':')[2]!r}"]
    except (Exception, SystemExit) as exc:  # SystemExit: a module that calls sys.exit
        return [f"model.class_path: importing {path!r} failed: {type(exc).__name__}: {exc}"]
    import lightning.pytorch as pl

    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        if isinstance(cls, type) and old_namespace(cls):
            return [f"model.class_path: {path!r}: {OLD_NAMESPACE_HINT}"]
        return [f"model.class_path: {path!r} is not a lightning.pytorch.LightningModule subclass"]
    from raytrain.spec import lightning_config

    # the model's arguments, by LightningCLI's parser (done before Ray when it names more)
    needs = lightning_config.needs_lightning(spec)
    problems = [] if needs else lightning_config.config_problems(spec)
    if (
        spec.strategy.needs_configure_model
        and cls.configure_model is pl.LightningModule.configure_model
    ):
        problems.append(_NO_CONFIGURE_MODEL.format(path=path))
    return problems


def check_pipeline_split(spec: JobSpec) -> list[str]:
    """A pipeline's stages found on the model as the workers will find them
    (``pipeline.split``): the model is built here, so a pipeline job pays Lightning's
    import before Ray starts, and a model that cannot be cut as asked is refused then."""
    stages = spec.strategy.pipeline_parallel_size
    if stages == 1:
        return []
    from raytrain.pipeline.split import HOOK, SplitError, chain, stage_ranges
    from raytrain.spec.lightning_config import build_model

    where = "strategy.model_parallel.pipeline.split_points"
    try:
        model = build_model(spec)
    except SpecError as exc:
        return exc.problems
    points = spec.strategy.model_parallel.pipeline.split_points
    name = type(model).__name__
    if callable(getattr(model, HOOK, None)):
        if points:
            return [f"{where}: {name} cuts itself ({HOOK}); give none"]
        return []
    import lightning.pytorch as pl

    if type(model).configure_model is not pl.LightningModule.configure_model:
        # it would shard the whole model (fully_shard(self), blocks another stage holds),
        # not the stage raytrain cuts, and the pipeline would never run its root
        return [
            f"model.class_path: {name} defines configure_model but not {HOOK}(mesh): "
            "under a pipeline a model that shards itself must also cut itself, returning "
            "its stage and sharding that (raytrain.models.tinygpt:TinyGPT does both); "
            "without either, raytrain cuts it and shards each stage with FSDP2"
        ]
    try:
        stage_ranges(chain(model), points, stages)
    except SplitError as exc:
        return [f"{where}: {exc}"]
    return []


def _data_functions(spec: JobSpec) -> list[tuple[str, str]]:
    """(field, import path) of ``data.preprocess`` and ``data.transform`` where set."""
    data = spec.files
    if data is None:
        return []
    return [(f, p) for f in ("preprocess", "transform") if (p := getattr(data, f)) is not None]


def data_functions_located(spec: JobSpec) -> list[str]:
    """``data.preprocess``'s and ``data.transform``'s modules can be found and bind their
    names, read from the source without running it (before Ray starts)."""
    problems = []
    for field, path in _data_functions(spec):
        problem = source_check.module_problem(path)
        if problem is None and source_check.binds(path) is False:
            module, _, name = path.partition(":")
            problem = f"module {module!r} has no attribute {name!r}"
        if problem:
            problems.append(f"data.{field}: {problem}")
    return problems


def check_data_functions(spec: JobSpec) -> list[str]:
    """``data.preprocess`` and ``data.transform`` import and are callable (they run in the
    workers' decoding processes or Ray Data's tasks, where a failed import would end the
    run, not name the field)."""
    problems: list[str] = []
    for field, path in _data_functions(spec):
        try:
            function = import_object(path)
        except (Exception, SystemExit) as exc:
            problems.append(f"data.{field}: cannot import {path!r}: {type(exc).__name__}: {exc}")
            continue
        if not callable(function):
            problems.append(f"data.{field}: {path!r} is not a function")
    return problems


def local_capacity(spec: JobSpec) -> dict[str, float]:
    """What an embedded local Ray cluster on this machine can ever give training workers.

    GPUs are counted (through torch, a second's import) only when ``spec`` asks for them."""
    capacity: dict[str, float] = {"CPU": float(os.cpu_count() or 1)}
    if spec.scaling.use_gpu is not True:
        return capacity
    try:
        import torch

        capacity["GPU"] = float(torch.cuda.device_count())
    except Exception:
        capacity["GPU"] = 0.0
    return capacity


def check_capacity(spec: JobSpec, capacity: dict[str, float]) -> list[str]:
    """``num_workers`` workers (the minimum, if a range) of ``resources_per_worker`` each
    fit into ``capacity``."""
    problems = []
    per_worker = spec.scaling.worker_resources()
    workers = spec.scaling.min_workers
    for resource, amount in per_worker.items():
        if amount <= 0:
            continue
        have = capacity.get(resource, 0.0)
        fits = int(have // amount)
        if fits < workers:
            field = (
                "scaling.use_gpu" if resource == "GPU" and spec.scaling.use_gpu is True else None
            )
            field = field or "scaling.num_workers"
            problems.append(
                f"{field}: {workers} workers need {workers * amount:g} {resource} "
                f"({amount:g} each) but the cluster can hold at most {have:g} "
                f"(room for {fits} worker{'s' if fits != 1 else ''})"
            )
    return problems


def check_local_cpus(spec: JobSpec) -> list[str]:
    """``$RAYTRAIN_LOCAL_CPUS``, if set, leaves Ray Data at least one CPU beside the workers."""
    from raytrain.driver.ray_runtime import LOCAL_CPUS_ENV, workers_cpus

    requested = os.environ.get(LOCAL_CPUS_ENV)
    if not requested:
        return []
    need = workers_cpus(spec) + 1
    if not requested.isdigit() or int(requested) < need:
        return [
            f"scaling.num_workers: {LOCAL_CPUS_ENV}={requested} must be a whole number of at "
            f"least {need}: the workers' {need - 1} CPUs and one for Ray Data"
        ]
    return []


def dataset_schema(uri: str, fmt: str, options: StorageSpec | None = None) -> pa.Schema:
    """The pyarrow schema of the dataset at ``uri`` (read from file footers/headers only)."""
    import pyarrow.dataset as pads

    fs, path = storage.filesystem(uri, options)
    return pads.dataset(path, filesystem=fs, format=fmt).schema


def dataset_schema_names(uri: str, fmt: str, options: StorageSpec | None = None) -> list[str]:
    """The column names of the dataset at ``uri`` (read from file footers/headers only)."""
    return list(dataset_schema(uri, fmt, options).names)


def tensor_type_problem(arrow_type: pa.DataType) -> str | None:
    """Why a column of ``arrow_type`` cannot become a tensor in a batch (Arrow -> numpy ->
    ``torch.as_tensor``, ``data.arrow_batch_to_tensors``), or None when it can: numbers and
    booleans, lists (fixed or not) of them, and tensor extension types."""
    import pyarrow as pa
    import pyarrow.types as pat

    if isinstance(arrow_type, pa.ExtensionType):
        return (
            tensor_type_problem(arrow_type.storage_type) if not _is_tensor_ext(arrow_type) else None
        )
    if pat.is_integer(arrow_type) or pat.is_floating(arrow_type) or pat.is_boolean(arrow_type):
        return None
    if pat.is_dictionary(arrow_type):
        return tensor_type_problem(arrow_type.value_type)
    lists = (pat.is_list, pat.is_large_list, pat.is_fixed_size_list)
    if any(is_list(arrow_type) for is_list in lists):
        inner = arrow_type.value_type
        if any(is_list(inner) for is_list in lists):  # becomes an object array, no tensor
            return (
                f"{arrow_type}, a list of lists, which cannot become a tensor (store it "
                "flat, or as a tensor column)"
            )
        return tensor_type_problem(inner)
    return f"{arrow_type}, which cannot become a tensor (numbers, booleans, or lists of them)"


def _is_tensor_ext(arrow_type: object) -> bool:
    return "Tensor" in type(arrow_type).__name__  # Ray Data's ArrowTensorType(V2), ...


# Storage checks (listings, a probe write) get this long in all; a store that has not
# answered by then is reported, instead of hanging the command.
STORAGE_CHECK_TIMEOUT_S = 25.0


def check_stores(spec: JobSpec, *, allow_prepare: bool = False) -> list[str]:
    """``check_storage`` and ``check_data``, side by side (a store that does not answer
    costs its retries once, not once per URI), given ``STORAGE_CHECK_TIMEOUT_S`` in all."""
    import time

    from raytrain.driver.background import Background

    tasks = [Background(lambda: check_storage(spec))]
    tasks += [
        Background(functools.partial(check_data, spec, allow_prepare=allow_prepare, only=f))
        for f in ("train", "val")
    ]
    deadline = time.monotonic() + STORAGE_CHECK_TIMEOUT_S
    problems: list[str] = []
    try:
        for task in tasks:
            problems += task.result(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        data = spec.files
        uris = [spec.checkpoint.storage]
        uris += [s.uri for _, s in data.train_sources()] if data else []
        uris += [data.val.uri] if data and data.val else []
        return [
            f"checkpoint.storage/data: no answer from {', '.join(uris)} within "
            f"{STORAGE_CHECK_TIMEOUT_S:.0f} s: the endpoint cannot be reached "
            "(check storage.*.endpoint_url and the network)"
        ]
    return problems


def check_storage(spec: JobSpec) -> list[str]:
    """The run's folder under ``checkpoint.storage`` can be listed, written and deleted
    from (object stores: a small probe file, removed again; local: permissions only)."""
    from raytrain.records.runstate import run_dir

    location = storage.resolve(spec.checkpoint.storage)
    if not storage.is_uri(location):
        parent = location
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            return [
                f"checkpoint.storage: {location}: cannot create or write it ({parent} "
                "is not a writable folder)"
            ]
        return []
    why = storage.check_writable(run_dir(spec), spec.storage)
    return [f"checkpoint.storage: {location}: {why}"] if why else []


def check_data(spec: JobSpec, *, allow_prepare: bool = False, only: str | None = None) -> list[str]:
    """Each dataset (or the ``only`` one: ``train``/``val``) exists, holds files of its
    format, and has the columns the spec projects.

    With ``allow_prepare``, a missing train set that ``data.prepare`` will write is no problem.
    """
    problems: list[str] = []
    options = spec.storage
    data = spec.files
    if data is None:  # a DataModule or the model's own loaders: built in the workers
        return problems

    # data.prepare runs when the train set is missing, and writes the val set too
    def will_prepare() -> bool:
        if not allow_prepare or data.prepare is None:
            return False
        first = data.train_sources()[0][1]
        return _missing(storage.resolve(first.uri), options) is not None

    sources = {**dict(data.train_sources()), "data.val": data.val}
    for field, source in sources.items():
        if source is None or (only is not None and not field.startswith(f"data.{only}")):
            continue
        uri = storage.resolve(source.uri)
        try:
            missing = _missing(uri, options)
            if missing is not None:
                if not will_prepare():
                    problems.append(f"{field}.uri: {missing}")
                continue
            names = _source_columns(source, uri, options, data.bad_images)
        except FilesProblem as exc:
            problems.append(f"{field}.{exc.field}: {exc}")
            continue
        except Exception as exc:
            problems.append(
                f"{field}.uri: cannot read {source.format} data at {uri}: {storage.describe(exc)}"
            )
            continue
        if not names:
            problems.append(f"{field}.uri: no {source.format} files found under {uri}")
            continue
        absent = [c for c in data.columns or [] if c not in names]
        if absent:
            problems.append(
                f"data.columns: {', '.join(map(repr, absent))} not in {field} "
                f"({uri} has: {', '.join(names)})"
            )
        elif source.format != "images" and data.preprocess is None:
            problems += _column_type_problems(data.columns, field, source, uri, options)
    if data.mixed and not problems and (only is None or only == "train"):
        problems += _mix_schema_problems(data, options)
    return problems


def _mix_schema_problems(data: DataSpec, options: StorageSpec | None) -> list[str]:
    """A mix's sources give the workers the same columns of the same types (its batches
    join rows of all of them): each compared with the first, from the footers."""
    sources = data.train_sources()
    try:
        schemas = [dataset_schema(storage.resolve(s.uri), s.format, options) for _, s in sources]
    except Exception:  # read once already (the column names): the run will say
        return []
    columns = data.columns or list(schemas[0].names)

    def shape(schema: pa.Schema) -> list[str]:
        return [
            f"{c} {schema.field(c).type}" if c in schema.names else f"{c} (absent)" for c in columns
        ]

    first = shape(schemas[0])
    return [
        f"{field}.uri: its columns differ from data.train.0's: "
        f"{', '.join(x for x in shape(schema) if x not in first)} against "
        f"{', '.join(x for x in first if x not in shape(schema))}"
        for (field, _), schema in zip(sources[1:], schemas[1:], strict=True)
        if shape(schema) != first
    ]


def _column_type_problems(
    projected: list[str] | None,
    field: str,
    source: SourceSpec,
    uri: str,
    options: StorageSpec | None,
) -> list[str]:
    """Each column the workers get (the projection, else all) can become a tensor, as the
    batches need; checked from the schema (a Parquet footer), not in the run. A
    ``data.preprocess`` step may turn any column into numbers, so it is not checked then."""
    try:
        schema = dataset_schema(uri, source.format, options)
    except Exception:  # read once already (the column names): the run will say
        return []
    out = []
    for name in projected or schema.names:
        why = tensor_type_problem(schema.field(name).type)
        if why is not None:
            where = "data.columns" if projected else f"{field}.uri"
            out.append(
                f"{where}: column {name!r} of {field} ({uri}) is {why}; project it away "
                "with data.columns, or convert it with data.preprocess"
            )
    return out


def _missing(uri: str, options: StorageSpec | None) -> str | None:
    """Why nothing can be read at ``uri`` (no such path, missing bucket, empty prefix), or
    None when something is there. Store errors (credentials, endpoint) raise."""
    if not storage.is_uri(uri):
        return None if os.path.exists(uri) else f"no such file or folder: {uri}"
    # A listing first: it tells rejected credentials apart from a missing key.
    if storage.list_dir(uri, options) or storage.exists(uri, options):
        return None
    bucket = storage.missing_bucket(uri, options)
    if bucket:
        return f"{uri}: the bucket {bucket!r} does not exist"
    return f"{uri}: nothing there (an empty or missing prefix)"


def _source_columns(
    source: SourceSpec, uri: str, options: StorageSpec | None, bad_images: str = "error"
) -> list[str]:
    """The columns a split's files give (for images: ``image``, and ``label`` when the
    files sit in class folders); empty when no file of the format is there."""
    from raytrain.data.image_files import BadImages, pack_manifest

    if storage.is_uri(uri) or os.path.isdir(uri):  # raytrain pack's folder: finished?
        try:
            pack_manifest(*storage.filesystem(uri, options))
        except BadImages as exc:
            raise FilesProblem(str(exc)) from None
    if source.format in ("csv", "json"):  # every row parsed (the plan is kept for the run)
        from raytrain.data.text_blocks import BadRows, plan_text

        fs, path = storage.filesystem(uri, options)
        try:
            return list(plan_text(source.uri, fs, path, source.format).schema.names)
        except BadRows as exc:
            raise FilesProblem(str(exc)) from None
    if source.format != "images":
        return dataset_schema_names(uri, source.format, options)
    from raytrain.data.image_files import list_images, packed_manifest, read_labels

    fs, path = storage.filesystem(uri, options)
    packed = packed_manifest(fs, path)
    if packed is not None:  # raytrain pack's shards: checked when they were packed
        if source.labels is not None:
            raise FilesProblem(
                "the folder is packed images, which hold their labels: drop "
                "labels (pack the folder with class folders)",
                "labels",
            )
        return ["image", "label"] if packed.get("classes") else ["image"]
    labels = None
    if source.labels is not None:
        try:
            labels = read_labels(source.labels, options)
        except BadImages as exc:
            raise FilesProblem(str(exc), "labels") from None
    try:  # every header read (bad_images: error), and no class folder without images
        images = list_images(uri, fs, path, check=bad_images == "error", labels=labels)
    except BadImages as exc:
        raise FilesProblem(str(exc)) from None
    return ["image", "label"] if images.labels is not None else ["image"]


class FilesProblem(Exception):
    """An image folder or text files that cannot be trained on, said as the problem's whole
    message; ``field``: the source's field it names (``uri``, or ``labels``)."""

    def __init__(self, message: str, field: str = "uri"):
        super().__init__(message)
        self.field = field


def raise_if(problems: list[str]) -> None:
    """Raise one ``SpecError`` listing every problem, if there are any."""
    if problems:
        raise SpecError(problems)
