"""CSV and JSON Lines files as blocks each rank reads itself, like Parquet's row groups.

The driver splits every file into blocks of about ``BLOCK_BYTES`` that end on a line's end
(a file's first line, a CSV header, belongs to no block) and parses each once with pyarrow,
in threads: that counts each block's rows, which is all an epoch's order needs
(``parquet_stream.EpochLayout`` treats a block as a row group), checks every row (a CSV
row with the wrong field count is named with its file before the run), and gives each
block's column types, unified over all blocks (an int column with a float further down is
a float everywhere; floats are float32, ``single``), so every rank parses every block into
the same schema.

The parse is a full read of the set on the driver, once per run start: cheap for the sets
CSV and JSON are used for, and the reason to ``raytrain pack`` a large set into Parquet.
The plan is kept for the process (``plan_text``'s memo, keyed by the files' sizes and
times), so the preflight's check and the run's placement parse once.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from raytrain.contract import StreamedSet

if TYPE_CHECKING:
    import pyarrow as pa
    from pyarrow.fs import FileSystem

BLOCK_BYTES = 16 * 2**20  # a block's bytes, about: a rank holds a few windows of them
PARSE_THREADS = 8
# a folder's files of a format: those with these extensions, when any have them (a README
# beside the CSV files is not parsed as one); else all its files
EXTENSIONS = {"csv": ("csv", "tsv", "txt"), "json": ("json", "jsonl", "ndjson")}
_MEMO: dict[tuple[Any, ...], StreamedSet] = {}
_MEMO_LOCK = threading.Lock()


class BadRows(ValueError):
    """A CSV or JSON file that cannot be read as rows; the message names the file."""


def _split(fs: FileSystem, path: str, header: bool) -> tuple[bytes, list[tuple[int, int]]]:
    """A file's first line (``header``: CSV) and its blocks as (offset, length), each
    ending on a line's end (the last one at the file's end)."""
    blocks: list[tuple[int, int]] = []
    first = b""
    with fs.open_input_file(path) as handle:
        size = handle.size()
        at = 0
        if header:
            head = handle.read_at(min(size, 2**20), 0)
            end = head.find(b"\n")
            first = head if end < 0 else head[: end + 1]
            at = len(first)
        while at < size:
            stop = min(at + BLOCK_BYTES, size)
            if stop < size:  # end the block on a line's end: look ahead for one
                tail = handle.read_at(min(2**20, size - stop), stop)
                end = tail.find(b"\n")
                while end < 0 and stop + len(tail) < size:  # a line longer than the look
                    stop += len(tail)
                    tail = handle.read_at(min(2**20, size - stop), stop)
                    end = tail.find(b"\n")
                stop = size if end < 0 else stop + end + 1
            blocks.append((at, stop - at))
            at = stop
    return first, blocks


def parse(
    data: bytes,
    fmt: str,
    names: list[str] | None,
    schema: pa.Schema = None,
    columns: list[str] | None = None,
) -> pa.Table:
    """A block's bytes as an Arrow table: CSV with ``names`` as its header, or JSON Lines;
    with ``schema``, its types (the unified ones); with ``columns``, only those."""
    import pyarrow as pa

    source = pa.BufferReader(data)
    if fmt == "csv":
        import pyarrow.csv as pacsv

        types = {f.name: f.type for f in schema} if schema is not None else None
        return pacsv.read_csv(
            source,
            read_options=pacsv.ReadOptions(column_names=names, use_threads=False),
            convert_options=pacsv.ConvertOptions(column_types=types, include_columns=columns),
        )
    import pyarrow.json as pajson

    parse_options = pajson.ParseOptions(explicit_schema=schema) if schema is not None else None
    table = pajson.read_json(
        source, read_options=pajson.ReadOptions(use_threads=False), parse_options=parse_options
    )
    return table.select(columns) if columns else table


def single(kind: Any) -> Any:
    """A text column's type as the batches give it: a number with a fraction is a float32
    (torch's default dtype: text holds no float64 worth keeping, and a model's float32
    weights refuse float64 inputs), in lists too; other types as parsed."""
    import pyarrow as pa

    if pa.types.is_floating(kind):
        return pa.float32()
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return pa.list_(single(kind.value_type))
    return kind


def _header_names(first: bytes, path: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    try:
        return pacsv.read_csv(pa.BufferReader(first)).column_names
    except Exception as exc:
        raise BadRows(f"{path}: its first line is no CSV header: {_said(exc)}") from None


def _said(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _where(fs: FileSystem, path: str, at: int, exc: Exception) -> str:
    """Where in its file a block's parse failed, and why: the file's line when pyarrow
    names the block's row (``Row #N``; the lines before the block are counted, a read
    made only for this message), else the block's first byte."""
    import re

    said = _said(exc)
    csv_row = re.search(r"Row #(\d+): ", said)  # pyarrow's CSV reader: from 1
    json_row = re.search(r" in row (\d+)$", said)  # its JSON reader: from 0
    row = csv_row or json_row
    if row is None:
        return f"in the lines from byte {at}: {said}"
    with fs.open_input_file(path) as handle:
        before = handle.read_at(at, 0).count(b"\n")
    line = before + int(row.group(1)) + (json_row is not None)
    return f"line {line}: {said.replace(row.group(0), '')}"


def _text_files(fs: FileSystem, path: str, fmt: str) -> list[Any]:
    """The file ``path``, or the files under it (hidden and ``_`` ones left out; those named
    for ``fmt`` alone, when there are any), sorted by path."""
    import pyarrow.fs as pafs

    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [info]
    infos = [
        i
        for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
        if i.type == pafs.FileType.File and not i.base_name.startswith((".", "_"))
    ]
    named = [i for i in infos if i.extension.lower() in EXTENSIONS[fmt]]
    return sorted(named or infos, key=lambda i: i.path)


def _one_header(files: list[str], firsts: list[Any]) -> list[str]:
    """The CSV files' header names (from each file's first block), the same in every file;
    a file with another header is a ``BadRows`` naming it."""
    names = _header_names(firsts[0], files[0])
    for f, first in zip(files[1:], firsts[1:], strict=True):
        if _header_names(first, f) != names:
            raise BadRows(
                f"{f}: its header {_header_names(first, f)} differs from {files[0]}'s {names}"
            )
    return names


def plan_text(uri: str, fs: FileSystem, path: str, fmt: str) -> StreamedSet:
    """The CSV or JSON Lines files under ``path``, split into blocks and parsed once (see
    the module docstring). A file that does not parse is a ``BadRows`` naming it, with
    where in it and pyarrow's words (for a CSV row with the wrong field count, the row)."""
    import pyarrow as pa

    infos = _text_files(fs, path, fmt)
    key = (uri, fmt, tuple((i.path, i.size, i.mtime_ns) for i in infos))
    with _MEMO_LOCK:
        if key in _MEMO:
            return _MEMO[key]
    if not infos:
        raise BadRows(f"no {fmt} files under {uri}")
    files = [i.path for i in infos]
    with ThreadPoolExecutor(PARSE_THREADS) as pool:
        splits = list(pool.map(lambda f: _split(fs, f, fmt == "csv"), files))
    names = _one_header(files, [first for first, _ in splits]) if fmt == "csv" else None
    units = [(j, at, length) for j, (_, blocks) in enumerate(splits) for at, length in blocks]

    def count(unit: tuple[int, int, int]) -> tuple[int, Any]:
        j, at, length = unit
        with fs.open_input_file(files[j]) as handle:
            data = handle.read_at(length, at)
        try:
            table = parse(data, fmt, names)
        except Exception as exc:
            raise BadRows(f"{files[j]}, {_where(fs, files[j], at, exc)}") from None
        return table.num_rows, table.schema

    with ThreadPoolExecutor(PARSE_THREADS) as pool:
        counted = list(pool.map(count, units))
    if not any(n for n, _ in counted):
        raise BadRows(f"no rows in the {fmt} files under {uri}")
    try:
        schema = pa.unify_schemas([s for _, s in counted], promote_options="permissive")
    except Exception as exc:
        raise BadRows(f"{uri}: its files' columns do not agree: {_said(exc)}") from None
    if names is not None:  # the header's order
        schema = pa.schema([schema.field(n) for n in names])
    schema = pa.schema([f.with_type(single(f.type)) for f in schema])
    found = StreamedSet(
        uri=uri,
        files=tuple(files),
        format=fmt,
        row_groups=tuple(
            (j, u, n) for u, ((j, _, _), (n, _)) in enumerate(zip(units, counted, strict=True)) if n
        ),
        blocks=tuple((at, length) for _, at, length in units),
        schema=schema,
    )
    with _MEMO_LOCK:
        _MEMO[key] = found
    return found


def read_block(
    streamed: StreamedSet, unit: int, columns: list[str] | None, handle: Any
) -> pa.Table:
    """Block ``unit`` of ``streamed`` (its file open as ``handle``) as an Arrow table of its
    unified schema, projected to ``columns``."""
    at, length = streamed.blocks[unit]
    names = streamed.schema.names if streamed.format == "csv" else None
    return parse(handle.read_at(length, at), streamed.format, names, streamed.schema, columns)
