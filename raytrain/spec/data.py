"""The ``data`` section: file sources read by Ray Data, or a LightningDataModule built in
each worker; absent, the model's own dataloaders feed it."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from raytrain.spec.classes import ClassSpec
from raytrain.spec.fields import (
    _IMPORT_PATH,
    _check_location,
    _Section,
    check_name,
    field_problem,
)


class DataModuleSpec(ClassSpec):
    """A LightningDataModule that builds the data in each worker: ``prepare_data`` once per
    node, ``setup`` on every rank, then its loaders, sharded by raytrain."""


MAX_IMAGE_SIDE = 16384  # pixels: a side past it is a typo, not a resize


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
        description="The files' format; `images`: image files, decoded by each rank's "
        "decoding processes (`data.num_workers`; by Ray Data with `data.preprocess_on`) into "
        "an `image` column, with a `label` column when they sit in one folder per class.",
    )
    image_size: tuple[int, int] | None = Field(
        default=None, description="`images`: resize every image to [height, width]."
    )
    image_mode: str | None = Field(
        default=None, description="`images`: a Pillow mode to convert to (`RGB`, `L`, ...)."
    )
    labels: str | None = Field(
        default=None,
        min_length=1,
        description="`images` in a flat folder: a CSV file (path or URI) with a header "
        "`path,label`: each image's path under `uri` and its class (a name, or an integer "
        "index); every image must have one. Unset: the class folders give the labels.",
    )

    @field_validator("labels")
    @classmethod
    def _labels_location(cls, value: str | None) -> str | None:
        return None if value is None else _check_location(value)

    @model_validator(mode="after")
    def _labels_for_images(self) -> SourceSpec:
        if self.labels is not None and self.format != "images":
            raise ValueError("labels is for `images` sources: other formats hold their labels")
        return self

    @field_validator("image_size")
    @classmethod
    def _positive_size(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and min(value) < 1:
            raise ValueError(f"height and width must be >= 1, got {list(value)}")
        if value is not None and max(value) > MAX_IMAGE_SIDE:
            raise ValueError(
                f"height and width must be at most {MAX_IMAGE_SIDE}, got "
                f"{list(value)} (a batch of such would not fit in memory)"
            )
        return value

    @field_validator("image_mode")
    @classmethod
    def _pillow_mode(cls, value: str | None) -> str | None:
        from PIL import Image

        if value is not None and value not in Image.MODES:
            raise ValueError(f"{value!r} is not a Pillow mode: one of {', '.join(Image.MODES)}")
        return value


class MixSourceSpec(SourceSpec):
    """One source of a mixed train set."""

    weight: float = Field(
        gt=0,
        allow_inf_nan=False,
        description="This source's share of each epoch's rows, relative to the other sources' "
        "weights (0.8 and 0.2: four rows of it for each of the other).",
    )
    name: str | None = Field(
        default=None,
        description="Its name in the run's metrics (`data/rows/NAME`): letters, digits, "
        "`._-`, starting with a letter or digit, no `..`; unset: the last part of its uri, "
        "which must be such a name.",
    )

    @field_validator("name")
    @classmethod
    def _metric_name(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value)

    @model_validator(mode="after")
    def _uri_names_it(self) -> MixSourceSpec:
        """Without a ``name``, the end of the uri names the source's metrics, so it follows
        the rule for names too (a uri ending ``/..`` names no source)."""
        if self.name is None:
            try:
                check_name(_uri_end(self.uri))
            except ValueError as exc:
                raise field_problem(
                    "uri",
                    f"its end names the source's metrics while `name` is unset: {exc}; set `name`",
                ) from None
        return self

    def label(self) -> str:
        """Its name, or the last part of its uri."""
        return self.name or _uri_end(self.uri)


def _uri_end(uri: str) -> str:
    """The last part of a uri: what names a mix source without a ``name``."""
    return uri.rstrip("/").rsplit("/", 1)[-1] or uri


class ShuffleSpec(_Section):
    seed: int = Field(default=0, description="Seed of the per-epoch shuffle of the train set.")
    buffer_size: int = Field(
        default=4096, ge=1, description="Rows held by each worker's local shuffle buffer."
    )


# Ray's node labels, as its label selectors take them (ray._private.label_utils)
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}")
_LABEL_VALUE = re.compile(rf"!?(in\({_LABEL_NAME}(, ?{_LABEL_NAME})*\)|{_LABEL_NAME})")


class DataSpec(_Section):
    train: Annotated[
        Annotated[SourceSpec, Tag("source")] | Annotated[list[MixSourceSpec], Tag("mix")],
        Discriminator(lambda v: "mix" if isinstance(v, list) else "source"),
    ] = Field(
        description="The training set: one source, or a mix, a list of Parquet sources each "
        "with a `weight`: each epoch draws `epoch_rows` rows from them by weight."
    )
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
        description="`module:function(batch) -> batch` over Ray Data's numpy batches (dicts "
        "of numpy arrays), run by each worker on every batch it reads (images: in its decoding "
        "processes), exact per epoch; with `preprocess_on`, a Ray Data `map_batches` step on "
        "those nodes instead.",
    )
    preprocess_on: dict[str, str] | None = Field(
        default=None,
        description="Decode and preprocess on these nodes, through Ray Data (images and sets "
        "with `preprocess`; and where Ray Data's tasks read a split to cache), as a Ray label "
        "selector: `{raytrain.io/role: data}` for the nodes started with `ray start --labels "
        "raytrain.io/role=data`. Unset: on a GPU run, the cluster's nodes without GPUs when it "
        "has any, else anywhere; `{}`: anywhere.",
    )

    @field_validator("preprocess_on")
    @classmethod
    def _selector(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        _check_selector(value or {})
        return value

    transform: str | None = Field(
        default=None,
        pattern=_IMPORT_PATH,
        description="`module:function(image) -> image`: each image's augmentation (`images` "
        "sources read per rank), run in the rank's decoding processes; it gets the decoded, "
        "resized, converted PIL image, as a torchvision transform does, and returns an array, "
        "a tensor or an image; the batch's `image` stacks what it returns.",
    )
    num_workers: int | None = Field(
        default=None,
        ge=0,
        description="Decoding processes per worker for `images` sources (0: decode on the "
        "training thread); unset: the CPUs each worker was given (at least 1).",
    )
    bad_images: Literal["error", "skip"] = Field(
        default="error",
        description="An image file Pillow cannot read (checked from its header before the "
        "run): `error` names it and stops; `skip` trains without such files and counts them.",
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
    epoch_rows: int | None = Field(
        default=None,
        ge=1,
        description="A mixed train set's epoch, in rows drawn from the sources by weight; "
        "unset: all the sources' rows together. A source drawn past its end starts over in a "
        "new order. Every rank holds which source each row of the epoch comes from, a byte a "
        "row (4 past 256 sources), up to 1 GiB: about a billion rows; more epochs of fewer "
        "rows draw as many.",
    )

    @field_validator("epoch_rows")
    @classmethod
    def _labels_fit(cls, value: int | None, info: ValidationInfo) -> int | None:
        train = info.data.get("train")
        sources = len(train) if isinstance(train, list) else 1
        problem = None if value is None else epoch_rows_problem(value, sources)
        if problem:
            raise ValueError(problem)
        return value

    batch_format: Literal["dict", "tuple"] = Field(
        default="dict",
        description="A batch as a dict of tensors by column (`dict`), or a tuple of them in "
        "`columns` order (`tuple`, for steps that unpack `x, y = batch`).",
    )

    @model_validator(mode="after")
    def _tuple_needs_columns(self) -> DataSpec:
        if self.batch_format == "tuple" and not self.columns:
            raise ValueError("batch_format tuple needs `columns`: the order of the tuple")
        return self

    @field_validator("train")
    @classmethod
    def _mix(cls, value: SourceSpec | list[MixSourceSpec]) -> SourceSpec | list[MixSourceSpec]:
        if isinstance(value, list):
            _check_mix(value)
        return value

    @model_validator(mode="after")
    def _options_go_together(self) -> DataSpec:
        problem = _combination_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def mixed(self) -> bool:
        """Whether the train set is a mix of sources."""
        return isinstance(self.train, list)

    def train_sources(self) -> list[tuple[str, SourceSpec]]:
        """The train set's sources with their field paths (``data.train``, or
        ``data.train.0`` and so on for a mix)."""
        if isinstance(self.train, list):
            return [(f"data.train.{i}", s) for i, s in enumerate(self.train)]
        return [("data.train", self.train)]


# The most bytes of one epoch's labels a mix's rank holds (``mix.MixedStream.labels``).
MAX_LABEL_BYTES = 2**30


def label_bytes(sources: int) -> int:
    """The bytes of one position's label in a mix of ``sources`` sources."""
    return 1 if sources <= 256 else 4


def epoch_rows_problem(rows: int, sources: int) -> str | None:
    """Why a mix's epoch of ``rows`` rows from ``sources`` sources is too large (its labels
    past ``MAX_LABEL_BYTES`` on every rank), or None."""
    size = rows * label_bytes(sources)
    if size <= MAX_LABEL_BYTES:
        return None
    return (
        f"{rows} rows: every rank would hold {size / 2**30:.3g} GiB of the epoch's "
        f"labels (a byte a row, 4 past 256 sources), more than the limit of "
        f"{MAX_LABEL_BYTES // 2**30} GiB: train more epochs of fewer rows"
    )


def _data_kind(value: Any) -> str | None:
    """Which kind of `data` section a value is: a DataModule has a `class_path`."""
    if isinstance(value, dict):
        return "module" if "class_path" in value else "files"
    if isinstance(value, BaseModel):
        return "module" if isinstance(value, DataModuleSpec) else "files"
    return None


# `data`: file sources (read by Ray Data on the driver's cluster), a LightningDataModule, or
# absent: the model's own train_dataloader/val_dataloader.
Data = Annotated[
    Annotated[DataSpec, Tag("files")] | Annotated[DataModuleSpec, Tag("module")],
    Discriminator(_data_kind),
]


def _check_selector(selector: dict[str, str]) -> None:
    """``preprocess_on`` is a Ray label selector: each key a label's name, each value a
    value, ``!value``, ``in(a,b)`` or ``!in(a,b)``."""
    for key, want in selector.items():
        if not _LABEL_KEY.fullmatch(key):
            raise ValueError(
                f"{key!r} is not a node label's name (letters, digits, "
                "'-', '_', '.', and one '/' after a prefix)"
            )
        if not _LABEL_VALUE.fullmatch(want):
            raise ValueError(
                f"{key}: {want!r} is not a label value, '!value', 'in(a,b)' or '!in(a,b)'"
            )


def _check_mix(sources: list[MixSourceSpec]) -> None:
    """A mix: at least one source, Parquet only, weights with a finite sum (quotas divide
    by it), and names that differ."""
    if not sources:
        raise ValueError("a mix needs at least one source")
    formats = sorted({s.format for s in sources} - {"parquet"})
    if formats:
        raise ValueError(f"a mix reads Parquet sources only, not {', '.join(formats)}")
    total = 0.0
    for j, source in enumerate(sources):
        total += source.weight
        if not math.isfinite(total):
            raise field_problem(
                f"{j}.weight",
                "the sources' weights sum past the largest float (to infinity): scale them "
                "down, only their ratios count",
            )
    names = [s.label() for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"the sources' names must differ: {', '.join(twice)} is given twice (set `name`)"
        )


def _combination_problem(data: DataSpec) -> str | None:
    """The first of the data section's options that do not go together, said; None."""
    if data.epoch_rows is not None and not data.mixed:
        return "epoch_rows is for a mixed train set (a list of sources)"
    if data.mixed and data.preprocess is not None:
        return "preprocess is not supported with a mixed train set"
    formats = {s.format for _, s in data.train_sources()} | (
        {data.val.format} if data.val else set()
    )
    if data.transform is not None and "images" not in formats:
        return (
            "transform is each image's augmentation: it needs an `images` source (use "
            "preprocess for other formats)"
        )
    sources = [*data.train_sources(), ("data.val", data.val)]
    labelled = [f for f, s in sources if s is not None and s.labels is not None]
    if labelled and data.preprocess_on is not None:
        return (
            f"{labelled[0]}.labels: a labels file is read where each rank reads its images, "
            "not by Ray Data (preprocess_on)"
        )
    if data.transform is not None and data.preprocess_on is not None:
        return (
            "transform runs where each rank decodes its images; with preprocess_on, images "
            "are decoded by Ray Data on those nodes: do the augmentation in preprocess there"
        )
    return None
