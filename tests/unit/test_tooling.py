"""The formatter owns the layout: no line opts out of it. (``tests/run`` runs ``ruff format
--check``; a ``fmt: skip`` or ``fmt: off`` would pass that check and drift.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPT_OUT = re.compile(r"#\s*fmt:\s*(skip|off)\b")


def opted_out(root: Path, tops: tuple[str, ...]) -> list[str]:
    """``file:line`` of every line of the Python files under ``root/top`` that turns the
    formatter off."""
    paths = sorted(p for top in tops for p in (root / top).rglob("*.py"))
    return [
        f"{path.relative_to(root)}:{number}"
        for path in paths
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if OPT_OUT.search(line)
    ]


def test_no_line_opts_out_of_the_formatter(tmp_path: Path) -> None:
    assert opted_out(ROOT, ("raytrain", "tests", "bench")) == []
    (tmp_path / "pkg").mkdir()  # the check catches one
    (tmp_path / "pkg" / "planted.py").write_text("x = [1,\n  2]  # fmt" + ": skip\n")
    assert opted_out(tmp_path, ("pkg",)) == ["pkg/planted.py:2"]


MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 150


def lengths(root: Path, top: str) -> tuple[dict[str, int], dict[str, int]]:
    """The line count of every function (nested and methods too) and every class under
    ``root/top``, by ``path:name``; of two with one name in a file, the longer."""
    import ast

    functions: dict[str, int] = {}
    classes: dict[str, int] = {}
    for path in sorted((root / top).rglob("*.py")):
        where = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                found = classes if isinstance(node, ast.ClassDef) else functions
                key, size = (
                    f"{where}:{node.name}",
                    (node.end_lineno or node.lineno) - node.lineno + 1,
                )
                found[key] = max(found.get(key, 0), size)
    return functions, classes


def test_no_function_over_60_lines_and_no_class_over_150(tmp_path: Path) -> None:
    functions, classes = lengths(ROOT, "raytrain")
    assert {k: n for k, n in functions.items() if n > MAX_FUNCTION_LINES} == {}
    assert {k: n for k, n in classes.items() if n > MAX_CLASS_LINES} == {}
    # the count sees a long function, nested or not
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(61))
    (tmp_path / "pkg" / "long.py").write_text(f"def outer():\n    def inner():\n{body}\n")
    found, _ = lengths(tmp_path, "pkg")
    assert found["pkg/long.py:outer"] > MAX_FUNCTION_LINES
    assert found["pkg/long.py:inner"] > MAX_FUNCTION_LINES
    # and a long class
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(60))
    (tmp_path / "pkg" / "big.py").write_text(f"class Big:\n{methods}")
    _, classes = lengths(tmp_path, "pkg")
    assert classes["pkg/big.py:Big"] > MAX_CLASS_LINES


_HANGS_IN_C = """
import signal, time

def test_hangs_where_no_signal_reaches():
    # as the gloo hang did: the main thread blocked in C++ (a destructor joining
    # threads), where a SIGALRM handler written in Python never runs
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(120)
"""


def test_a_test_hung_in_native_code_is_ended_by_the_timeout(tmp_path: Path) -> None:
    """pytest-timeout's default (signal) method cannot end a test whose main thread is
    blocked in native code, and a hang there once held CI for 27 minutes: the project's
    configuration must use the thread method, which dumps every stack and exits."""
    import subprocess
    import sys
    import tomllib

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    method = options["ini_options"]["timeout_method"]
    (tmp_path / "test_planted.py").write_text(_HANGS_IN_C)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "--timeout",
            "2",
            "--timeout-method",
            method,
            str(tmp_path / "test_planted.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "Timeout" in done.stdout + done.stderr
    assert "test_hangs_where_no_signal_reaches" in done.stdout + done.stderr
