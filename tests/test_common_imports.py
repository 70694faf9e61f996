"""``common/`` is the floor: no module under it imports ``services`` (function-level
imports included), and the pool's shared half imports no torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "common"


def imported(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports, from any statement in it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


def test_the_reader_sees_function_level_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from services.cache_pool import store\n    import torch\n")
    assert imported(probe) == {"services.cache_pool", "torch"}


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_common_imports_nothing_from_services(path):
    bad = {m for m in imported(path) if m == "services" or m.startswith("services.")}
    assert not bad, f"{path.relative_to(ROOT.parent)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted((ROOT / "pool").glob("*.py")), ids=lambda p: p.name)
def test_the_pool_package_imports_no_torch(path):
    assert not {m for m in imported(path) if m.split(".")[0] in ("torch", "numpy")}
