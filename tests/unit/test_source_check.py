"""Reading a model's source instead of importing it: found names, LightningModule bases."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from raytrain.driver.source_check import defines_method, is_lightning_module, top_level_names

MODULES = {
    "pkg/__init__.py": "",
    "pkg/base.py": (
        "import lightning.pytorch as pl\n"
        "class Base(pl.LightningModule):\n    pass\n"
        "class NotOne:\n    pass\n"
    ),
    "pkg/models.py": (
        "from .base import Base, NotOne\n"
        "import lightning as L\n"
        "from lightning.pytorch import LightningModule as LM\n"
        "import torch\n"
        "class Child(Base):\n    pass\n"
        "class Aliased(L.LightningModule):\n    pass\n"
        "class Renamed(LM):\n    pass\n"
        "class Plain(NotOne):\n    pass\n"
        "class Torchy(torch.nn.Module):\n    pass\n"
        "Built = type('Built', (Base,), {})\n"
        "try:\n    from .base import Base as Reexported\nexcept ImportError:\n    pass\n"
    ),
    "pkg/parallel.py": (
        "import lightning.pytorch as pl\n"
        "from .models import Child\n"
        "from nosuch_compiled_ext import Mixin\n"
        "def hook(self):\n    pass\n"
        "class Own(pl.LightningModule):\n    def configure_model(self):\n        pass\n"
        "class Inherits(Own):\n    pass\n"
        "class Assigned(pl.LightningModule):\n    configure_model = hook\n"
        "class Without(Child):\n    pass\n"
        "class Unknowable(Mixin, pl.LightningModule):\n    pass\n"
    ),
}


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for rel, text in MODULES.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("name", ["Child", "Aliased", "Renamed", "Reexported"])
def test_lightning_modules_are_recognised_from_source(pkg: Path, name: str) -> None:
    assert is_lightning_module("pkg.models", name)
    assert "pkg.models" not in sys.modules  # read, not imported


@pytest.mark.parametrize("name", ["Plain", "Torchy", "Built", "Missing"])
def test_what_the_source_cannot_show_is_not_claimed(pkg: Path, name: str) -> None:
    # not a LightningModule, or built at run time: the caller imports to know
    assert not is_lightning_module("pkg.models", name)


def test_the_bundled_models_are_recognised() -> None:
    assert is_lightning_module("raytrain.models.digits", "DigitsCNN")
    assert is_lightning_module("bench.timed", "TimedDigitsCNN")  # base from another module


def test_top_level_names(pkg: Path) -> None:
    names = top_level_names(str(pkg / "pkg" / "models.py"))
    assert names is not None
    assert {"Child", "Built", "Reexported", "Base", "L", "LM", "torch"} <= names
    assert "Missing" not in names
    (pkg / "star.py").write_text("from os import *\n")
    assert top_level_names(str(pkg / "star.py")) is None  # cannot know


@pytest.mark.parametrize(
    ("name", "defined"),
    [
        ("Own", True),
        ("Inherits", True),
        ("Assigned", True),
        ("Without", False),
        ("Unknowable", None),
    ],
)
def test_a_method_is_found_on_the_class_or_its_bases_short_of_lightnings(
    pkg: Path, name: str, defined: bool | None
) -> None:
    # None: a base the source cannot show (a compiled module); the caller imports to know
    assert defines_method("pkg.parallel", name, "configure_model") is defined
    assert "pkg.parallel" not in sys.modules


def test_the_bundled_models_configure_model_is_read_from_source() -> None:
    assert defines_method("raytrain.models.tinygpt", "TinyGPT", "configure_model") is True
    assert defines_method("tests.integration.models", "ProbedGPT", "configure_model") is True
    assert defines_method("raytrain.models.digits", "DigitsCNN", "configure_model") is False
