"""No import circle among tandem's modules, and the engine does not reach the processes
that run it: read from the source (ast), so it holds for imports inside functions too."""
import ast
from pathlib import Path

import pytest

import tandem

PACKAGE = Path(tandem.__file__).resolve().parent


def _module_name(path: Path, root: Path) -> str:
    parts = ("tandem",) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The tandem modules `path` imports, anywhere in the file (TYPE_CHECKING blocks included:
    a circle there still ties the two files together). `from pkg import mod` counts as mod."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, name, modules) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def _reaches(graph: dict[str, set[str]], start: str, target: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == target:
            return True
        if node not in seen:
            seen.add(node)
            todo += graph[node]
    return False


def test_tandem_has_no_import_circle():
    graph = import_graph()
    assert "tandem.engine" in graph and "tandem.distributed.worker" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("upper", ["tandem.entrypoints.ranks", "tandem.entrypoints.llm",
                                   "tandem.server.engine_process"])
def test_the_engine_does_not_reach_its_entry_points(upper):
    """The entry points build the rank runtime and the engine; the engine imports neither."""
    graph = import_graph()
    assert _reaches(graph, upper, "tandem.engine")
    assert not _reaches(graph, "tandem.engine", upper)


def test_the_check_finds_a_circle(tmp_path):
    """The check itself can fail: a package whose modules import each other is caught,
    through a `from . import` and a function-level import alike."""
    pkg = tmp_path / "tandem"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from tandem.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("import tandem.a\n")
    (pkg / "d.py").write_text("import tandem.c\n")
    cycle = find_cycle(import_graph(pkg))
    assert cycle == ["tandem.a", "tandem.sub.b", "tandem.c", "tandem.a"]
