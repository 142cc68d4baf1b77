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
