"""The hand-written package list in pyproject.toml must cover every subpackage."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "rltk").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found - listed == set(), f"add these to [tool.setuptools] packages: {sorted(found - listed)}"


def test_every_entry_point_module_exists():
    import importlib.util

    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["rltk"]
    for name, module in eps.items():
        assert importlib.util.find_spec(module) is not None, f"entry point {name} -> {module} missing"
