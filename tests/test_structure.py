"""The shape the code keeps: no import circle under server/, no thread-local step state, no
module past about 400 lines, a README a newcomer reads in minutes."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def server_imports() -> dict[str, set[str]]:
    """Each server module -> the server modules it imports (anywhere in its body)."""
    graph = {}
    for path in (ROOT / "server").rglob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("server"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("server")}
        graph[module_name(path)] = deps
    return graph


def test_no_import_circle_under_server():
    graph = server_imports()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, " -> ".join([*path[path.index(name):], name])
        if name in done or name not in graph:
            return
        for dep in graph[name]:
            visit(dep, [*path, name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_no_thread_local_and_no_huge_module():
    for path in (ROOT / "server").rglob("*.py"):
        text = path.read_text()
        assert "threading.local" not in text, path
        assert len(text.splitlines()) <= 420, path


def test_readme_is_short_and_the_reference_docs_exist():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    for doc in ("docs/architecture.md", "docs/reference.md", "benchmarks/RESULTS.md"):
        assert (ROOT / doc).is_file(), doc
