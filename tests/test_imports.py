"""The package's modules import each other without a cycle.

Only imports that run when a module is loaded count (module level, outside
``if TYPE_CHECKING:``); an import inside a function runs later and cannot
leave a module half-initialised.
"""

from __future__ import annotations

import ast
import pathlib

import balancer

ROOT = pathlib.Path(balancer.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _load_time_imports(tree: ast.Module) -> list[ast.stmt]:
    """Statements that import at load time: the module body, descending into
    ``if``/``try`` blocks but not ``if TYPE_CHECKING:``."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in _load_time_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        if state.get(node) == 1:
            return path[path.index(node):] + [node]
        if state.get(node) == 2:
            return None
        state[node] = 1
        for dep in sorted(graph[node]):
            found = visit(dep, path + [node])
            if found:
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        found = visit(node, [])
        if found:
            return found
    return None


def test_the_package_has_no_load_time_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 40 and "balancer.partition._worker" in graph, "every module was read"
    assert "balancer.transformer_cost" in graph["balancer.workloads"], "the graph sees module-level imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
