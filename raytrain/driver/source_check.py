"""What a module's source says without running it.

Importing a LightningModule's module costs seconds (Lightning, torch) that the driver need
not spend: the workers import it anyway. The driver reads the source instead to check that
the class exists and derives from ``LightningModule``; where the source cannot tell (a
class built at run time, a base from a compiled module), the caller imports for real.
"""

from __future__ import annotations

import ast
import importlib.util

# Where LightningModule comes from, under the names users import it by. The older
# ``pytorch_lightning`` package's is another class, which Ray's Lightning strategies do not
# train: a module deriving from it is imported and refused (``preflight.check_model``).
_LIGHTNING_MODULES = {
    "lightning",
    "lightning.pytorch",
    "lightning.pytorch.core",
    "lightning.pytorch.core.module",
}
_MAX_DEPTH = 8


def _origin(module: str) -> str | None:
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return found.origin if found is not None else None


def _parse(origin: str | None) -> ast.Module | None:
    if not origin or not origin.endswith(".py"):
        return None
    try:
        with open(origin, encoding="utf-8") as handle:
            return ast.parse(handle.read(), origin)
    except (OSError, SyntaxError, ValueError):
        return None  # importing it reports the problem


def module_problem(path: str) -> str | None:
    """Why the module of ``path`` (``pkg.mod:Name``) cannot be imported, found without
    running it (a missing module or parent package); None when it is there."""
    module = path.partition(":")[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # a parent package is missing or broken
        return f"cannot import {path!r}: {exc}"
    if found is None:
        return f"cannot import {path!r}: No module named {module!r}"
    return None


def binds(path: str) -> bool | None:
    """Whether the source of ``path``'s module binds its name at top level; None when that
    cannot be known (see ``top_level_names``)."""
    module, _, name = path.partition(":")
    names = top_level_names(_origin(module))
    return None if names is None else name in names


def top_level_names(origin: str | None) -> set[str] | None:
    """The names a module's source binds at top level; None when that cannot be known (no
    Python source, a star import or a module ``__getattr__``)."""
    tree = _parse(origin)
    if tree is None:
        return None
    names: set[str] = set()
    for node in _statements(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.partition(".")[0])
        for target in _assigned(node):
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return None if "__getattr__" in names else names


def _assigned(node: ast.AST) -> list[ast.AST]:
    """The targets a statement binds names in."""
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, ast.AnnAssign | ast.AugAssign | ast.For):
        return [node.target]
    if isinstance(node, ast.With):
        return [item.optional_vars for item in node.items if item.optional_vars is not None]
    return []


def _statements(tree: ast.Module) -> list[ast.stmt]:
    """Top-level statements, including those under top-level if/try/with/for/while."""
    out: list[ast.stmt] = []
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        out.append(node)
        if isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
            for field in ("body", "orelse", "finalbody"):
                pending.extend(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                pending.extend(handler.body)
    return out


def _package(module: str, origin: str) -> str:
    return module if origin.endswith("__init__.py") else module.rpartition(".")[0]


def _imports(module: str, origin: str, tree: ast.Module) -> dict[str, tuple[str, str | None]]:
    """name -> (module, attribute) for each top-level import; attribute None for a module."""
    out: dict[str, tuple[str, str | None]] = {}
    for node in _statements(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = (alias.name, None)
                else:  # `import a.b` binds `a`
                    root = alias.name.partition(".")[0]
                    out[root] = (root, None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package(module, origin).split(".")
                parent = ".".join(package[: len(package) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                out[alias.asname or alias.name] = (base, alias.name)
    return out


def _dotted(node: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def is_lightning_module(module: str, name: str, _depth: int = 0) -> bool:
    """True when the source shows ``module:name`` to be a class deriving, through classes
    whose sources it can follow, from Lightning's ``LightningModule``; False when it cannot
    tell (the caller then imports it to know)."""
    if _depth > _MAX_DEPTH:
        return False
    origin = _origin(module)
    tree = _parse(origin)
    if tree is None or origin is None:
        return False
    imports = _imports(module, origin, tree)
    classes = {n.name: n for n in _statements(tree) if isinstance(n, ast.ClassDef)}
    if name not in classes:
        source, attr = imports.get(name, (None, None))
        if source is None or attr is None:
            return False
        if source in _LIGHTNING_MODULES:
            return attr == "LightningModule"
        return is_lightning_module(source, attr, _depth + 1)
    for base in classes[name].bases:
        parts = _dotted(base)
        if not parts:
            continue
        if len(parts) == 1:
            known = parts[0] in classes or parts[0] in imports
            if known and is_lightning_module(module, parts[0], _depth + 1):
                return True
            continue
        # `pl.LightningModule`, `lightning.pytorch.LightningModule`, `L.LightningModule`
        root = imports.get(parts[0])
        if root is not None and root[1] is None:
            dotted = ".".join([root[0], *parts[1:-1]])
            if dotted in _LIGHTNING_MODULES and parts[-1] == "LightningModule":
                return True
            if is_lightning_module(dotted, parts[-1], _depth + 1):
                return True
    return False


def _defines(body: list[ast.stmt], method: str) -> bool:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method:
            return True
        targets = _assigned(node) if isinstance(node, (ast.Assign, ast.AnnAssign)) else []
        if any(isinstance(t, ast.Name) and t.id == method for t in targets):
            return True
    return False


def defines_method(module: str, name: str, method: str, _depth: int = 0) -> bool | None:
    """Whether the source shows class ``module:name``, or a base of it short of Lightning's
    own classes, defining ``method``: True, False (every base followed to Lightning without
    one), or None when it cannot tell (a base it cannot read; the caller imports to know)."""
    if _depth > _MAX_DEPTH:
        return None
    origin = _origin(module)
    tree = _parse(origin)
    if tree is None or origin is None:
        return None
    imports = _imports(module, origin, tree)
    classes = {n.name: n for n in _statements(tree) if isinstance(n, ast.ClassDef)}
    if name not in classes:
        source, attr = imports.get(name, (None, None))
        if source is None or attr is None:
            return None
        if source in _LIGHTNING_MODULES:
            return False  # Lightning's own class: its hooks are the defaults
        return defines_method(source, attr, method, _depth + 1)
    if _defines(classes[name].body, method):
        return True
    unknown = False
    for base in classes[name].bases:
        parts = _dotted(base)
        if not parts:
            unknown = True
            continue
        if len(parts) == 1:
            found = defines_method(module, parts[0], method, _depth + 1)
        else:
            root = imports.get(parts[0])
            if root is None or root[1] is not None:
                unknown = True
                continue
            dotted = ".".join([root[0], *parts[1:-1]])
            found = (
                False
                if dotted in _LIGHTNING_MODULES
                else defines_method(dotted, parts[-1], method, _depth + 1)
            )
        if found:
            return True
        unknown = unknown or found is None
    return None if unknown else False
