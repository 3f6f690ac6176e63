"""The package's imports run one way: no cycles, the layer rules of STYLE.md section 1, no huge files.

Every module under conveyor/ is parsed with `ast` (nothing is imported), and each `import` or
`from ... import` anywhere in it counts: at module level, inside functions, under `if TYPE_CHECKING:`.
A lazy import hides a cycle from the interpreter, not from the reader, so it counts as a real edge.
Relative imports are resolved against the importing module. `from pkg import name` is an edge to
`pkg.name` when that is a module, otherwise to `pkg` itself.

Package `__init__` modules: importing `conveyor.a.b` runs `conveyor/__init__` and `conveyor/a/__init__`
first, but that implicit edge is not recorded; with it every package that re-exports its children
would look cyclic by construction. What an `__init__` itself imports is counted like any module's
imports, so a re-exporting `__init__` whose child reaches back to the package (`from conveyor import
kernels` in a module `kernels/__init__` depends on) is reported as a cycle. The top-level
`conveyor/__init__.py` is the public API: it may import downward (LLM, configs), and modules that
import it (`from conveyor import __version__`) must not close a loop through it either.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "conveyor"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
MAX_LINES = 400   # Python and the live view's page (the C kernels: tests/model/test_kernel_contract.py)

# Lowest first: no module of a layer imports one of a later layer.
# `server -> front -> engine -> runtime -> model` is STYLE.md's order; kernels sit under the model, text
# (tokenizers, chat templates) beside it for the grammar compiler and the front, Ray Serve replicas run
# the server's app, and the CLI is the top: only `python -m conveyor` imports it.
LAYERS = ("conveyor.kernels", "conveyor.model", "conveyor.text", "conveyor.runtime", "conveyor.engine",
          "conveyor.front", "conveyor.server", "conveyor.replicas", "conveyor.cli")
MAX_MODULES = 12   # a package with more holds more than one concern
CORE_MAY_IMPORT = ("conveyor.config", "conveyor.errors", "conveyor.sampling_params", "conveyor.core")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # A package's own name is its anchor for level 1; a module's is its parent package.
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    edges = set()
    for target in found:
        # `import conveyor.a.b` names a module; keep the longest prefix that is one of ours.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: each is one tangle of cycles (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, to name in the failure message."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    return paths[node] + [start]
                if succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    following.append(succ)
        frontier = following
    raise AssertionError(f"component without a cycle: {sorted(component)}")


def test_no_import_cycles() -> None:
    graph = _graph()
    tangles = [f"{' -> '.join(_a_cycle(graph, component))}   (all in the loop: {', '.join(sorted(component))})"
               for component in _cycles(graph)]
    assert not tangles, "import cycles:\n" + "\n".join(tangles)


def test_layers_import_downward_only() -> None:
    wrong: list[str] = []
    for name, targets in _graph().items():
        for target in sorted(targets):
            if _under(name, "conveyor.core"):
                if not any(_under(target, allowed) for allowed in CORE_MAY_IMPORT):
                    wrong.append(f"{name} -> {target}")
            for i, layer in enumerate(LAYERS):
                if _under(name, layer) and any(_under(target, upper) for upper in LAYERS[i + 1:]):
                    wrong.append(f"{name} -> {target}")
            if _under(target, "conveyor.cli") and not _under(name, "conveyor.cli") and name != "conveyor.__main__":
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layer rules:\n" + "\n".join(sorted(set(wrong)))


def test_packages_stay_small() -> None:
    counts: dict[str, int] = {}
    for path in ROOT.rglob("*.py"):
        if path.name != "__init__.py":
            package = _module_name(path.parent / "__init__.py")
            counts[package] = counts.get(package, 0) + 1
    big = {package: count for package, count in counts.items() if count > MAX_MODULES and package != PACKAGE}
    assert not big, f"packages over {MAX_MODULES} modules: {big}"


def test_source_files_stay_small() -> None:
    suffixes = (".py", ".js", ".html", ".css")
    long = {str(path.relative_to(ROOT.parent)): count for path in ROOT.rglob("*") if path.suffix in suffixes
            if (count := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"source files over {MAX_LINES} lines: {long}"


def test_the_graph_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The parser itself: a function-level import and a relative one both become edges."""
    modules = {"conveyor.a": tmp_path / "a.py", "conveyor.b": tmp_path / "b.py", "conveyor.pkg": tmp_path / "i.py",
               "conveyor.pkg.c": tmp_path / "c.py"}
    modules["conveyor.a"].write_text("def f():\n    from conveyor.b import thing\n")
    modules["conveyor.pkg.c"].write_text("from .. import a\nfrom . import c2\n")
    assert _imports("conveyor.a", modules["conveyor.a"], modules) == {"conveyor.b"}
    assert _imports("conveyor.pkg.c", modules["conveyor.pkg.c"], modules) == {"conveyor.a", "conveyor.pkg"}
    graph = {"x": {"y"}, "y": {"z", "x"}, "z": {"x"}, "w": {"x"}}
    assert _cycles(graph) == [{"x", "y", "z"}] and _a_cycle(graph, {"x", "y", "z"}) == ["x", "y", "x"]
