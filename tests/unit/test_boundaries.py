"""The rules the package layout stands for, held by reading the source (and, for what the
driver imports, by importing it in a fresh interpreter).

- No import cycle, counting the imports inside functions (which hide one from Python but not
  from a reader): each module can be read after the ones it imports.
- The driver side loads without Lightning: a bad spec is refused before it would load.
- The worker package never imports the driver package: a worker gets a ``WorkerConfig``;
  and the rest imports ``worker/`` only through ``worker.entry``, what the driver hands
  Ray Train. ``_compat`` imports nothing of raytrain but ``errors``.
- Only ``raytrain._compat`` names a private API of Ray, Lightning, MLflow or torch.
- Only the ``raytrain.storage`` package branches on a storage URI's scheme, and only
  ``raytrain.spec.strategy_checks`` and ``raytrain.worker.strategy`` on the strategy's name.
- The top of ``raytrain/`` holds packages, and no module but ``__init__``, ``__main__`` and
  ``errors``.

Each rule is a function of a module graph or a syntax tree, so each test below also checks
that its rule catches a violation written for it (a rule that can never fail holds nothing).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fresh_process import run_fresh

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "raytrain"
FOREIGN = ("ray", "lightning", "pytorch_lightning", "torch", "mlflow")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, ast.Module]:
    """Every raytrain module's syntax tree, by module name."""
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in PACKAGE.rglob("*.py")}


def imported(tree: ast.AST, module: str) -> Iterator[str]:
    """Every module name ``tree`` imports, at any depth (function-level imports too);
    ``from a import b`` yields ``a`` and ``a.b`` (b may be a module)."""
    package = module if module in {"raytrain"} else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The raytrain modules ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), set()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def import_graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Which raytrain modules each imports. ``raytrain`` itself (the package every module
    is inside) imports the launcher only when ``raytrain.fit`` is asked for: no edges."""
    return {
        name: {m for m in imported(tree, name) if m in trees and m != "raytrain"}
        for name, tree in trees.items()
    }


# -- no import cycles ---------------------------------------------------------------------------


def without_type_checking(tree: ast.Module) -> ast.Module:
    """``tree`` less its ``if TYPE_CHECKING:`` blocks: imports for annotations only, which
    never run."""
    body = [
        node
        for node in tree.body
        if not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
    ]
    return ast.Module(body=body, type_ignores=[])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's
    algorithm), each sorted: every import cycle is inside one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, set()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_even_through_imports_inside_functions() -> None:
    trees = {name: without_type_checking(tree) for name, tree in sources().items()}
    assert cycles(import_graph(trees)) == []
    # a cycle planted through a function-level import, two modules apart, is found
    trees["raytrain.data.order"].body.append(
        ast.parse("def f():\n    from raytrain.data.loaders import worker_loaders")
    )
    planted = {"raytrain.data.loaders", "raytrain.data.order"}
    assert any(planted <= set(component) for component in cycles(import_graph(trees)))


# -- the worker never imports the driver ------------------------------------------------------


def driver_reached_from_worker(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    graph = import_graph(trees)
    return {
        name: {m for m in reachable(graph, name) if m.startswith("raytrain.driver")}
        for name in trees
        if name.startswith("raytrain.worker")
    }


def test_the_worker_package_never_imports_the_driver_package() -> None:
    trees = sources()
    assert {k: v for k, v in driver_reached_from_worker(trees).items() if v} == {}
    # the rule sees a violation, even one made through another module
    trees["raytrain.data.loaders"].body.append(
        ast.parse("def f():\n    import raytrain.driver.preflight")
    )
    assert "raytrain.driver.preflight" in driver_reached_from_worker(trees)["raytrain.worker.loop"]


# -- the rest reaches worker/ through its one door; _compat stands on errors alone --------------

WORKER_DOOR = "raytrain.worker.entry"


def worker_doors(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """The ``worker/`` modules each module outside ``worker/`` imports directly, function-
    level imports counted, other than its door (``worker.entry``)."""
    graph = import_graph(trees)
    return {
        name: found
        for name, targets in graph.items()
        if not name.startswith("raytrain.worker")
        and (found := {t for t in targets if t.startswith("raytrain.worker") and t != WORKER_DOOR})
    }


def compat_reaches(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """The raytrain modules each ``_compat`` module imports, other than ``_compat`` and
    ``errors``."""
    graph = import_graph(trees)
    return {
        name: found
        for name, targets in graph.items()
        if name.startswith("raytrain._compat")
        and (
            found := {
                t for t in targets if not t.startswith(("raytrain._compat", "raytrain.errors"))
            }
        )
    }


def test_the_rest_reaches_the_worker_only_through_its_entry_and_compat_only_errors() -> None:
    trees = sources()
    assert worker_doors(trees) == {}
    assert compat_reaches(trees) == {}
    # each rule catches its violation: the driver taking a worker module for a constant,
    # and _compat calling up into the worker
    trees["raytrain.driver.launcher"].body.append(
        ast.parse("def f():\n    from raytrain.worker.precision_table import TABLE")
    )
    trees["raytrain.worker.precision_table"] = ast.parse("TABLE = {}")
    trees["raytrain._compat.lightning"].body.append(
        ast.parse("def g():\n    from raytrain.worker import grad_clip")
    )
    assert worker_doors(trees)["raytrain.driver.launcher"] == {"raytrain.worker.precision_table"}
    assert compat_reaches(trees)["raytrain._compat.lightning"] >= {"raytrain.worker.grad_clip"}


# -- private APIs only in _compat -------------------------------------------------------------

_PRIVATE_MODULE = re.compile(r"\b(?:" + "|".join(FOREIGN) + r")(?:\.\w+)*\._[a-z]\w*")


def foreign_aliases(tree: ast.Module) -> dict[str, str]:
    """The names ``tree`` binds to foreign modules or to objects imported from them, with
    what each names (``pkg.mod`` or ``pkg.mod:Name``)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FOREIGN:
                    bound = alias.asname or alias.name.split(".")[0]
                    names[bound] = alias.name if alias.asname else bound
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FOREIGN:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}:{alias.name}"
    return names


def _foreign_class(base: ast.expr, aliases: dict[str, str]) -> type | None:
    """The foreign class a class statement's ``base`` names, imported; None if not one."""
    import importlib

    chain = []
    root = base
    while isinstance(root, ast.Attribute):
        chain.insert(0, root.attr)
        root = root.value
    if not isinstance(root, ast.Name) or root.id not in aliases:
        return None
    module, _, name = aliases[root.id].partition(":")
    value = importlib.import_module(module)
    for part in [name, *chain] if name else chain:
        value = getattr(value, part)
    return value if isinstance(value, type) else None


def private_uses(tree: ast.Module) -> list[str]:
    """Where ``tree`` names a private API of a foreign library: an import from a private
    module or of a private name, a private attribute of a foreign module or of a Lightning
    object, a private module named in a string (a logger's name), and overriding a foreign
    class's private method."""
    found = []
    foreign_names = {"trainer", "fit_loop", "loop", "strategy"}  # Lightning objects by name
    aliases = foreign_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names]
            mod = getattr(node, "module", None) or ""
            for full in [mod, *names] if isinstance(node, ast.ImportFrom) else names:
                foreign = full.split(".")[0] in FOREIGN or mod.split(".")[0] in FOREIGN
                parts = full.split(".")
                if foreign and any(p.startswith("_") and not p.startswith("__") for p in parts):
                    found.append(f"line {node.lineno}: imports {mod + ':' if mod else ''}{full}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue
            base = node.value
            root = base
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and (
                root.id in FOREIGN or root.id in foreign_names or root.id in aliases
            ):
                found.append(f"line {node.lineno}: .{node.attr}")
            if isinstance(base, ast.Call) and getattr(base.func, "id", "") == "super":
                found.append(f"line {node.lineno}: super().{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _PRIVATE_MODULE.search(node.value):
                found.append(f"line {node.lineno}: names {_PRIVATE_MODULE.search(node.value)[0]}")
        elif isinstance(node, ast.ClassDef):
            bases = [c for b in node.bases if (c := _foreign_class(b, aliases)) is not None]
            for item in node.body:
                if not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                private = item.name.startswith("_") and not item.name.startswith("__")
                if private and any(hasattr(c, item.name) for c in bases):
                    found.append(f"line {item.lineno}: overrides {node.name}.{item.name}")
    return found


def test_only_compat_names_private_apis_of_other_libraries() -> None:
    outside = {
        name: uses
        for name, tree in sources().items()
        if not name.startswith("raytrain._compat") and (uses := private_uses(tree))
    }
    assert outside == {}
    # each shape of violation is caught
    for code in (
        "from ray.train.v2._internal.execution.controller import TrainController",
        "from ray._raylet import RAY_NODE_ID_KEY",
        "from torch.distributed.checkpoint.state_dict_loader import _load_state_dict",
        "import ray._private.ray_constants",
        "x = torch._foreach_norm(grads)",
        "import torch.distributed.checkpoint.filesystem as dcp_fs\ninfo = dcp_fs._StorageInfo",
        "from torch.distributed.checkpoint import filesystem\ninfo = filesystem._StorageInfo",
        "def f(trainer):\n    return trainer.fit_loop._combined_loader",
        "logger = 'ray._private.runtime_env.working_dir'",
        "from ray.train.lightning import RayFSDPStrategy\n"
        "class S(RayFSDPStrategy):\n    def _setup_model(self, m):\n        return m\n"
        "    def _own_helper(self):\n        return 1",
    ):
        assert private_uses(ast.parse(code)), code


def test_compat_is_what_touches_them() -> None:
    # the other side of the rule: the private uses exist, all in _compat
    inside = {
        name: uses
        for name, tree in sources().items()
        if name.startswith("raytrain._compat") and (uses := private_uses(tree))
    }
    assert set(inside) >= {
        "raytrain._compat.ray_train",
        "raytrain._compat.lightning",
        "raytrain._compat.torch",
    }


# -- one package branches on the URI scheme, two modules on the strategy ----------------------

_SCHEMES = {"s3", "gs", "gcs", "abfs", "abfss", "az", "wasb", "wasbs", "hdfs", "file"}


def _scheme_literal(node: ast.AST) -> bool:
    if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
        return False
    return node.value.lower().rstrip(":/") in _SCHEMES or node.value == "://"


def scheme_branches(tree: ast.Module) -> list[int]:
    """Lines that compare against a storage URI scheme (``== "s3"``, ``in ("gs", ...)``,
    ``"://" in x``) or test one with ``startswith``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            flat = [
                e for s in sides for e in (s.elts if isinstance(s, ast.Tuple | ast.Set) else [s])
            ]
            if any(_scheme_literal(e) for e in flat):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "startswith":
            args = (
                node.args[0].elts
                if node.args and isinstance(node.args[0], ast.Tuple)
                else node.args
            )
            if any(_scheme_literal(a) for a in args):
                lines.append(node.lineno)
    return lines


def strategy_branches(tree: ast.Module) -> list[int]:
    """Lines that compare ``<...>.strategy.name`` with anything."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if (
                    isinstance(side, ast.Attribute)
                    and side.attr == "name"
                    and isinstance(side.value, ast.Attribute)
                    and side.value.attr == "strategy"
                ):
                    lines.append(node.lineno)
    return lines


# Addresses that are not storage: the job server's http(s) address and MLflow's store URIs
# are parsed by their own modules (their schemes are http/https/sqlite, never a store's).
_NOT_STORAGE = {"raytrain.submit.connection", "raytrain.tracking.mlflow_tracker"}


def in_storage(name: str) -> bool:
    """Whether module ``name`` is the ``raytrain.storage`` package or one of its modules."""
    return name == "raytrain.storage" or name.startswith("raytrain.storage.")


def test_only_storage_branches_on_the_uri_scheme() -> None:
    trees = sources()
    found = {
        name: lines
        for name, tree in trees.items()
        if not in_storage(name) and (lines := scheme_branches(tree))
    }
    assert set(found) <= _NOT_STORAGE, found
    # the exempt modules do not branch on a store's scheme either: only on "://" in an address
    for name in _NOT_STORAGE & set(found):
        source = (PACKAGE / Path(*name.split(".")[1:])).with_suffix(".py").read_text()
        for line in found[name]:
            text = source.splitlines()[line - 1]
            assert not re.search(r"['\"](s3|gs|gcs|abfss?|az|file)(://)?['\"]", text), text
    # where it happens, the rule sees it: telling a path from a URI, and a store's endpoint
    assert scheme_branches(trees["raytrain.storage.locations"])
    assert scheme_branches(trees["raytrain.storage.filesystems"])
    for code in (
        'ok = uri.startswith("s3://")',
        'remote = "://" in uri',
        'if scheme in ("gs", "gcs"):\n    pass',
    ):
        assert scheme_branches(ast.parse(code)), code


def _private_key(node: ast.AST) -> bool:
    """A string literal of the shape raytrain's event keys had: ``"_failure"``."""
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"_[a-z][a-z0-9_]*", node.value) is not None
    )


def _reads_by_key(node: ast.AST) -> bool:
    """``x["_key"]`` or ``"_key" in x``."""
    if isinstance(node, ast.Subscript):
        return _private_key(node.slice)
    return (
        isinstance(node, ast.Compare)
        and _private_key(node.left)
        and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
    )


def event_keys(tree: ast.Module) -> list[int]:
    """Lines that define a ``*_KEY`` constant of a private key (``FAILURE_KEY = "_failure"``)
    or read a mapping by one (``event["_hang"]``, ``"_checkpoint" in event``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _private_key(node.value):
            if any(isinstance(t, ast.Name) and t.id.endswith("_KEY") for t in node.targets):
                lines.append(node.lineno)
        elif _reads_by_key(node):
            lines.append(node.lineno)
    return lines


def test_events_are_typed_and_read_by_no_string_key() -> None:
    """What a worker sends the driver is ``contract.events``' frozen types, dispatched by
    type; the one private key left is ``SCORE_KEY``, Ray Train's ranking attribute in the
    dict ``ray.train.report`` takes, defined in ``contract`` and nowhere else."""
    trees = sources()
    found = {name: lines for name, tree in trees.items() if (lines := event_keys(tree))}
    assert found == {"raytrain.contract.events": found.get("raytrain.contract.events", [])}
    assert found["raytrain.contract.events"]  # where it is, the rule sees it
    for code in (
        'FAILURE_KEY = "_failure"',
        'if "_worker_started_at" in event:\n    pass',
        'why = event["_stopped"]',
    ):
        assert event_keys(ast.parse(code)), code


# The strategy's checks on the spec (before Ray), and its construction in the workers.
STRATEGY_MODULES = ("raytrain.spec.strategy_checks", "raytrain.worker.strategy")


def test_only_the_strategy_modules_branch_on_the_strategy_name() -> None:
    trees = sources()
    found = {
        name: lines
        for name, tree in trees.items()
        if name not in STRATEGY_MODULES and (lines := strategy_branches(tree))
    }
    assert found == {}
    assert all(strategy_branches(trees[name]) for name in STRATEGY_MODULES)
    assert strategy_branches(ast.parse('sharded = spec.strategy.name == "fsdp"'))


# -- the driver loads without Lightning -------------------------------------------------------

DRIVER_SIDE = sorted(
    name
    for name in sources()
    if name.startswith(
        ("raytrain.driver", "raytrain.cli", "raytrain.submit", "raytrain.sweep", "raytrain.records")
    )
    or in_storage(name)
    or name
    in {
        "raytrain",
        "raytrain.spec",
        "raytrain.contract",
        "raytrain.checkpoints.layout",
        "raytrain.data.sources",
        "raytrain.tracking.mlflow_tracker",
        "raytrain.tracking.report",
    }
)

_IMPORT_ALL = """
import importlib, json, sys
names = json.loads(sys.argv[1])
for name in names:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in ("lightning", "pytorch_lightning") if m in sys.modules)))
"""


@pytest.mark.parametrize("extra", [[], ["raytrain.worker.strategy"]], ids=["driver", "violation"])
def test_importing_the_driver_side_leaves_lightning_out(extra: list[str], tmp_path: Path) -> None:
    # "violation": a module that imports Lightning, appended as if the driver imported it
    names = DRIVER_SIDE + extra
    if extra:
        names = [*names, "raytrain.worker.callbacks"]
    loaded = run_fresh(_IMPORT_ALL, names, tmp_path, pythonpath=str(ROOT), timeout=240)
    assert loaded == (["lightning"] if extra else []), loaded


# -- the top of raytrain/ holds packages ------------------------------------------------------

TOP_MODULES = {"__init__.py", "__main__.py", "errors.py"}


def loose_at_top(top: Path) -> list[str]:
    """What the top of the package folder ``top`` holds other than packages and
    ``TOP_MODULES``: a module (``storage.py``), or a folder of modules with no
    ``__init__.py`` (a namespace package, imported by accident)."""
    modules = [p.name for p in top.glob("*.py") if p.name not in TOP_MODULES]
    folders = [
        f"{p.name}/"
        for p in top.iterdir()
        if p.is_dir() and any(p.glob("*.py")) and not (p / "__init__.py").exists()
    ]
    return sorted(modules + folders)


def test_the_top_of_raytrain_holds_only_packages_and_its_own_modules(tmp_path: Path) -> None:
    assert loose_at_top(PACKAGE) == []
    # the rule sees both violations: a loose module, and a folder of modules that is no package
    for name in ("__init__.py", "errors.py", "storage.py", "spec/__init__.py", "util/paths.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    assert loose_at_top(tmp_path) == ["storage.py", "util/"]
