"""The docs pages generated from the code match it, and every module says what it is."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_pages_are_what_the_code_says(tmp_path: Path) -> None:
    """Run ``python docs/generate.py`` when this fails: a module added, removed, or its
    docstring's first paragraph changed."""
    generate = _generator()
    for path, text in generate.pages().items():
        assert path.read_text(encoding="utf-8") == text, f"{path.name}: run docs/generate.py"
    # the check sees a module the page lacks
    (tmp_path / "raytrain" / "new").mkdir(parents=True)
    (tmp_path / "raytrain" / "new" / "thing.py").write_text('"""Does a new thing.\n\nMore."""\n')
    page = generate.modules_page(tmp_path)
    assert "## `raytrain/new/`" in page and "- `thing.py`: Does a new thing." in page


def test_every_module_has_a_docstring_that_says_what_it_is() -> None:
    page = (ROOT / "docs" / "modules.md").read_text(encoding="utf-8")
    assert "(no docstring)" not in page


def test_the_architecture_page_links_only_to_pages_that_exist() -> None:
    docs = ROOT / "docs"
    for page in [docs / "architecture.md", docs / "decisions" / "index.md"]:
        for target in re.findall(r"\]\(([^)#]+\.md)\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.name} links to {target}"
    assert len((docs / "architecture.md").read_bytes()) <= 12_000


def test_every_spec_field_says_what_it_is() -> None:
    """A field without a description shows as an empty cell in the reference."""
    page = (ROOT / "docs" / "reference" / "spec.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert rows and [r for r in rows if r.rstrip().endswith("|  |")] == []
