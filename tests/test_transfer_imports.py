"""The data plane's module layout: the imports among ``common/transfer/*.py`` form no
cycle, the interface imports no backend, and every backend is laid out the same way.

Imports are read from the source (every import statement, function-level ones
included: an import deferred into a function is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "common.transfer"
ROOT = Path(__file__).resolve().parents[1] / "common" / "transfer"
MODULES = {path.stem: path for path in ROOT.glob("*.py")}
KINDS = ("tcp", "shm", "ucx")
BACKEND_MODULES = {m for m in MODULES if m.split("_")[0] in KINDS} | {
    "frame_reader",
    "backends",
    "factory",
    "multi",
}


def intra_imports(name: str) -> set[str]:
    """The modules of this package that module ``name`` imports (``__init__`` for names
    taken from the package itself)."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x / from .x import y
                base = ".".join([PACKAGE, base] if base else [PACKAGE])
            targets = [(base, [alias.name for alias in node.names])]
        else:
            continue
        for module, names in targets:
            if module == PACKAGE:
                for imported in names or ["__init__"]:
                    found.add(imported if imported in MODULES else "__init__")
            elif module.startswith(PACKAGE + "."):
                found.add(module[len(PACKAGE) + 1 :].split(".")[0])
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    return {name: intra_imports(name) for name in MODULES}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_reader_sees_every_kind_of_import():
    edges = graph()
    assert "base" in edges["table"]  # from common.transfer.base import ...
    assert {"wire", "control"} <= edges["shm"]  # from common.transfer import control, wire
    assert {"tcp_receiver", "shm_receiver", "ucx_receiver"} <= edges["backends"]  # in functions
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_data_plane():
    assert find_cycle(graph()) is None


def test_the_interface_imports_no_backend():
    base = intra_imports("base")
    assert not base & BACKEND_MODULES, base
    assert base == set(), base  # the interface stands alone
    # Nothing under the package reaches for its own __init__ (the public face).
    assert [m for m, deps in graph().items() if "__init__" in deps] == []


def test_every_backend_has_a_protocol_a_sender_and_a_receiver_module():
    for kind in KINDS:
        assert {kind, f"{kind}_sender", f"{kind}_receiver"} <= set(MODULES), kind
        # The sender and receiver of a backend share its protocol module, not each other.
        assert f"{kind}_receiver" not in intra_imports(f"{kind}_sender")
        assert f"{kind}_sender" not in intra_imports(f"{kind}_receiver")


def test_every_module_is_short():
    lines = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert max(lines.values()) < 400, lines
