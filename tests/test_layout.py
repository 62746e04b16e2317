"""relay's layout holds: no import cycle between its modules, and no package imports one above
it. Read from the source (every `import`, at module level or inside a function), not by
importing, so a lazy import that would close a cycle counts too."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
from support import REPO

PACKAGE = REPO / "platform" / "relay"

# Lowest first. A module may import its own package and any package of a lower layer; never one
# of its own layer (training and serving are separate flows) or above. "(root)" is relay's
# __init__, the public API, which imports the flows.
LAYERS = [
    {"version", "models"},
    {"tasks"},
    {"config"},
    {"checkpoints"},
    {"parallel", "runtime", "records"},
    {"observe"},
    {"training", "serving"},
    {"tuning"},
    {"cli", "(root)"},
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """The relay modules `path` imports (`from relay.x import name` counts as relay.x.name
    when that is a module, else relay.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                as_module = f"{node.module}.{alias.name}"
                found.add(as_module if as_module in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    found = modules(root)
    known = set(found)
    return {name: imports(path, known) - {name} for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                on_stack.discard(member)
                component.append(member)
            on_stack.discard(node)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def layer_of(package: str) -> int:
    (layer,) = [i for i, members in enumerate(LAYERS) if package in members]
    return layer


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        source = package_of(module)
        for target in sorted(targets):
            into = package_of(target)
            if into != source and layer_of(into) >= layer_of(source):
                found.append(f"{module} imports {target}")
    return found


@pytest.mark.timeout(60)
def test_no_module_of_relay_is_part_of_an_import_cycle():
    assert cycles(import_graph()) == []


@pytest.mark.timeout(60)
def test_every_package_has_a_layer_and_imports_only_those_below_it():
    graph = import_graph()
    assert {package_of(m) for m in graph} == set().union(*LAYERS)
    assert upward_imports(graph) == []


@pytest.mark.timeout(60)
def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """Both checks on a copy of the package with two imports added: one closes a cycle
    (checkpoints.layout → checkpoints.checkpoint, which imports layout), one goes upward
    (records → tuning). Each check reports its own."""

    copy = tmp_path / "relay"
    shutil.copytree(PACKAGE, copy)
    layout = copy / "checkpoints" / "layout.py"
    layout.write_text(layout.read_text() + "\nfrom relay.checkpoints import checkpoint\n")
    registry = copy / "records" / "registry.py"
    registry.write_text(registry.read_text() + "\nfrom relay.tuning import sweep\n")

    graph = import_graph(copy)
    closed = {"relay.checkpoints.checkpoint", "relay.checkpoints.layout"}
    assert any(closed <= set(component) for component in cycles(graph)), cycles(graph)
    assert "relay.records.registry imports relay.tuning.sweep" in upward_imports(graph)


def redefined_names(source: str) -> list[str]:
    """Module-level functions and classes defined twice in `source`: Python keeps the last, so
    every caller of the first silently runs the second (ruff's F811 sees only a name redefined
    before any use)."""
    seen: set[str] = set()
    twice = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name in seen:
                twice.append(node.name)
            seen.add(node.name)
    return twice


def test_no_module_defines_a_function_or_class_twice():
    assert redefined_names(
        "def f(a):\n    return g(a)\n\n\ndef g(a):\n    pass\n\n\ndef f(): pass\n"
    ) == ["f"]
    found = {
        name: twice
        for name, path in modules().items()
        if (twice := redefined_names(path.read_text()))
    }
    assert found == {}, found
