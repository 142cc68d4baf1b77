"""Reading a spec file: YAML within limits.

A real spec is a few KiB and a few hundred nodes; hostile input (an alias bomb, a huge file,
deep nesting, a key given twice) is refused quickly, naming the file.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from raytrain.errors import SpecError
from raytrain.spec.fields import MAX_SPEC_DEPTH


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
    _check_nesting(text, source)
    loader = _SpecLoader(text)
    try:
        root = loader.get_single_node()
        if root is not None:
            _check_expansion(root, source)
        return loader, root
    except BaseException:
        loader.dispose()
        raise


def _check_nesting(text: str, source: str) -> None:
    """The text's own nesting, from the event stream (no recursion, no graph built)."""
    depth = 0
    for event in yaml.parse(text, Loader=_BaseLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_SPEC_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark else "?"
                raise SpecError(
                    f"{source}: nested deeper than the limit of {MAX_SPEC_DEPTH} "
                    f"levels (at line {line})"
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check_expansion(root: Any, source: str) -> None:
    """The graph's size and depth with every alias expanded, counted once per distinct node
    (children before parents, on an explicit stack); a node reached again while its
    children are counted is a recursive alias."""
    recursive = f"{source}: a recursive alias (a node that contains itself) is not allowed"
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
                raise SpecError(recursive)
            busy.add(id(node))
            stack.append((node, True))
            stack.extend((kid, False) for kid in kids if id(kid) not in sizes)
            continue
        if any(id(kid) not in sizes for kid in kids):  # reached only through a cycle
            raise SpecError(recursive)
        count = 1 + sum(sizes[id(kid)][0] for kid in kids)
        deep = 1 + max((sizes[id(kid)][1] for kid in kids), default=0)
        if count > MAX_SPEC_NODES:
            raise SpecError(
                f"{source}: expands into more than the limit of {MAX_SPEC_NODES:,} YAML "
                "nodes (aliases count each time they are used)"
            )
        if deep > MAX_SPEC_DEPTH + 1:
            raise SpecError(
                f"{source}: nested deeper than the limit of {MAX_SPEC_DEPTH} levels "
                "(through aliases)"
            )
        sizes[id(node)] = (count, deep)
        busy.discard(id(node))


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
