"""The package layout holds: ``common/`` is the floor, nothing imports in a circle, the
data plane's interface stands alone and every backend is laid out alike, and every source
file is short enough to read in one sitting.

Imports are read from the source (``ast``), so a module counts as importing another
whether the import sits at the top, inside a function or under ``TYPE_CHECKING``: each
is a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "services", "kernels")
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module ``name`` refers to: itself, or the package holding it when
    ``name`` is an attribute imported from a package (``from pkg import thing``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, known)
            if target is not None and target != module:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _is_package_init(module: str) -> bool:
    return (ROOT / module.replace(".", "/") / "__init__.py").exists()


def _imported_names(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports, third-party ones included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


def test_the_reader_sees_every_kind_of_import():
    graph = _graph()
    assert "common.transfer.base" in graph["common.transfer.table"]  # from x.base import y
    assert {"common.transfer.wire", "common.transfer.control"} <= graph["common.transfer.shm"]
    backends = graph["common.transfer.backends"]  # imports inside functions count
    assert {f"common.transfer.{k}_receiver" for k in KINDS} <= backends


def test_common_imports_nothing_from_services():
    graph = _graph()
    wrong = {m: sorted(t for t in targets if t.startswith("services"))
             for m, targets in graph.items() if m.startswith("common")}
    assert {m: t for m, t in wrong.items() if t} == {}


def test_no_import_cycles():
    graph = _graph()
    # A package's __init__ re-exporting its own modules is not a circle a reader follows.
    for module, targets in graph.items():
        if _is_package_init(module):
            continue
        graph[module] = {t for t in targets if not (_is_package_init(t)
                                                    and module.startswith(t + "."))}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_pool_package_and_the_simulated_engine_import_no_torch():
    paths = [*sorted((ROOT / "common" / "pool").glob("*.py")),
             *(ROOT / "services" / "engine" / f"{m}.py" for m in ("sim", "core", "kv_store"))]
    heavy = {str(p.relative_to(ROOT)): sorted(n for n in _imported_names(p)
                                              if n.split(".")[0] in ("torch", "numpy"))
             for p in paths}
    assert {p: names for p, names in heavy.items() if names} == {}


KINDS = ("tcp", "shm", "ucx")


def test_the_transfer_interface_imports_nothing_of_its_package():
    graph = _graph()
    assert {t for t in graph["common.transfer.base"] if t.startswith("common.transfer")} == set()
    # Nothing inside the package reaches for its public face, the package's __init__.
    assert [m for m, t in graph.items()
            if m.startswith("common.transfer.") and "common.transfer" in t] == []


def test_every_transfer_backend_has_a_protocol_a_sender_and_a_receiver_module():
    graph = _graph()
    for kind in KINDS:
        base = f"common.transfer.{kind}"
        assert {base, f"{base}_sender", f"{base}_receiver"} <= set(graph), kind
        # Sender and receiver share the backend's protocol module, not each other.
        assert f"{base}_receiver" not in graph[f"{base}_sender"]
        assert f"{base}_sender" not in graph[f"{base}_receiver"]


def test_no_worker_part_imports_the_worker():
    graph = _graph()
    parts = {f"services.worker.{m}" for m in ("decode_role", "prefill_role", "pool_link")}
    assert parts | {"services.worker.context"} <= graph["services.worker.server"]
    assert [m for m, t in graph.items() if m.startswith("services.worker.")
            and "services.worker.server" in t] == []
    assert all("services.worker.context" in graph[part] for part in parts)


def test_source_files_are_short():
    long = {str(p.relative_to(ROOT)): n for pkg in (*PACKAGES, "bench")
            for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
