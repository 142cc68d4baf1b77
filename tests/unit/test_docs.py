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


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def test_every_whole_spec_in_the_docs_is_valid() -> None:
    """A YAML block with a ``name`` and a ``model`` is a whole spec: it must validate as
    ``raytrain validate`` would (the schema: the data it names need not exist here)."""
    import pytest
    import yaml

    from raytrain.errors import SpecError
    from raytrain.spec import parse_spec

    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    whole = []
    for page in pages:
        for block in _blocks(page.read_text(encoding="utf-8"), "yaml"):
            tree = yaml.safe_load(block)
            if isinstance(tree, dict) and {"name", "model"} <= set(tree):
                parse_spec(tree, source=page.name)
                whole.append(page.name)
    assert "spec.md" in whole and "README.md" in whole
    with pytest.raises(SpecError, match=r"trainer\.max_epochs"):  # it sees a bad one
        parse_spec(
            {
                **yaml.safe_load(_blocks((ROOT / "docs" / "spec.md").read_text(), "yaml")[0]),
                "trainer": {"max_epochs": "ten"},
            }
        )


def test_the_quickstart_page_runs_what_ci_runs() -> None:
    """The quickstart's commands are the README's ``ci:setup`` and ``ci:test`` blocks,
    which CI runs (``.ci/run``)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = [re.search(rf"<!-- ci:{k} -->\n```sh\n(.*?)```", readme, re.S) for k in ("setup", "test")]
    assert all(ci)
    page = _blocks((ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8"), "sh")
    assert page[:2] == [m.group(1) for m in ci if m]
