"""The shape the code keeps: no import circle under server/ (every import form), imports that
point one way (engine below the API, models below the engine, each API sub-package only to
those below it), no thread-local step state, no module past 400 lines or function past 80, and
a README whose module map is the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "storage", "cli")


def module_name(path: Path, root: Path = ROOT) -> str:
    name = ".".join(path.relative_to(root).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """The modules of ours that `path` imports anywhere in its body, in every form: `import
    a.b`, `from a.b import name` (a.b), `from a import b` where b is a module (a.b, not a:
    importing a.b runs a's __init__ first whoever asks), and relative imports (resolved
    against the module's package)."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            modules = {f"{base}.{a.name}" for a in node.names}
            modules = {m for m in modules if _is_module(m, root)}
            found |= modules
            if len(modules) < len(node.names):  # names defined in `base` itself
                found.add(base)
    return {m for m in found if m.split(".")[0] in PACKAGES and m != me}


def _is_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of ours -> the modules of ours it imports."""
    return {module_name(p, root): imported_modules(p, root)
            for package in PACKAGES for p in (root / package).rglob("*.py")}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name):], name]
        if name in done or name not in graph:
            return None
        for dep in sorted(graph[name]):
            circle = visit(dep, [*path, name])
            if circle:
                return circle
        done.add(name)
        return None

    for name in sorted(graph):
        circle = visit(name, [])
        if circle:
            return circle
    return None


def test_no_import_circle_anywhere():
    circle = find_circle(import_graph())
    assert circle is None, " -> ".join(circle)


def test_a_circle_put_back_is_found(tmp_path):
    """The check sees `from server.api import x` and relative imports: the circle that
    responses.py and background.py once made, rebuilt in a scratch tree, is found."""
    api = tmp_path / "server" / "api"
    api.mkdir(parents=True)
    (tmp_path / "server" / "__init__.py").write_text("")
    (api / "__init__.py").write_text("")
    (api / "responses.py").write_text("from server.api import background\n")
    (api / "background.py").write_text("def f():\n    from .responses import ResponseRun\n")
    (tmp_path / "storage").mkdir()
    (tmp_path / "cli").mkdir()
    circle = find_circle(import_graph(tmp_path))
    assert circle is not None and set(circle) == {"server.api.responses",
                                                  "server.api.background"}


# Layers of the HTTP layer, lowest first: a module may import server.api modules of a lower
# layer or of its own package, never a sibling package of its layer (openai and anthropic
# never import each other), never a higher one. Top-level modules of server/api are the
# shared plumbing (layer 0), but app.py joins everything.
API_LAYERS = {"": 0, "generation": 1, "openai": 2, "anthropic": 2, "ollama": 2, "rerank": 2,
              "ops": 2,
              "batch": 3, "app": 4}


def api_package(module: str) -> str:
    """server.api.openai.chat -> "openai"; server.api.state -> "" (plumbing); app -> "app"."""
    first = module.removeprefix("server.api").lstrip(".").split(".")[0]
    return first if first == "app" or (ROOT / "server/api" / first).is_dir() else ""


def test_api_sub_packages_import_only_downward():
    for module, deps in import_graph().items():
        if not module.startswith("server.api"):
            continue
        mine = api_package(module)
        for dep in deps:
            if not dep.startswith("server.api") or dep == "server.api":
                continue
            theirs = api_package(dep)
            assert theirs == mine or API_LAYERS[theirs] < API_LAYERS[mine], \
                f"{module} ({mine or 'plumbing'}) imports {dep} ({theirs or 'plumbing'})"


@pytest.mark.parametrize("lower, higher", [
    ("server.engine", ("server.api", "cli")),
    ("server.models", ("server.engine", "server.api", "cli")),
    ("server.quant", ("server.models", "server.engine", "server.api", "cli")),
    ("server.kernels", ("server.quant", "server.models", "server.engine", "server.api", "cli")),
    ("storage", ("server.api", "cli")),
])
def test_packages_import_one_way(lower, higher):
    for module, deps in import_graph().items():
        if module.startswith(lower):
            wrong = sorted(d for d in deps if d.startswith(higher))
            assert not wrong, f"{module} imports {wrong}"


def test_no_thread_local_no_huge_module_no_long_function():
    for path in (ROOT / "server").rglob("*.py"):
        text = path.read_text()
        assert "threading.local" not in text, path
        assert len(text.splitlines()) <= 400, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                assert length <= 80, f"{path}:{node.lineno} {node.name} has {length} lines"


def test_kernels_are_one_package_whose_sources_include_only_headers():
    """Every C source is in server/kernels; a .c includes headers only, and the bf16
    conversion (NaN-safe) is written once, in common.h."""
    kernels = ROOT / "server/kernels"
    assert {p.parent for p in (ROOT / "server").rglob("*.[ch]")} == {kernels}
    for source in kernels.glob("*.[ch]"):
        included = re.findall(r'#include\s+"([^"]+)"', source.read_text())
        assert all(name.endswith(".h") for name in included), (source.name, included)
        defines = re.findall(r"uint16_t float_to_bf16\(float", source.read_text())
        assert len(defines) == (source.name == "common.h"), source.name


def test_readme_is_short_and_the_reference_docs_exist():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    for doc in ("docs/architecture.md", "docs/reference.md", "benchmarks/RESULTS.md"):
        assert (ROOT / doc).is_file(), doc
    # current numbers only (history is git's): the llama-server shapes of the model families
    # (Gemma 3 1B, Llama 3.2 3B) took it past 400
    assert len((ROOT / "benchmarks/RESULTS.md").read_text().splitlines()) < 430


MAPPED = (".py", ".c", ".h")


def readme_map() -> dict[str, set[str]]:
    """The README's module map: folder -> the names it lists there (files, and sub-folders
    ending in /), read from each line's first column (names, then two spaces, then what they
    are); folders outside server/, storage/ and cli/ are not checked."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Module map", 1)[1].split("```")[1]
    listed: dict[str, set[str]] = {}
    folder = None
    for line in block.splitlines():
        head = re.match(r"(\S+/)\s", line + " ")
        if head:
            folder = head.group(1)
            line = line[len(folder):]
        if folder is None or folder.split("/")[0] not in PACKAGES:
            continue
        names = listed.setdefault(folder, set())
        column = re.split(r"\s{2,}", line.strip())[0]  # the names, then the description
        for word in column.split():
            if word.endswith(MAPPED) or word.endswith("/"):
                names.add(word)
    return listed


def tree_map() -> dict[str, set[str]]:
    """The same from the tree: every source folder under server/, storage/ and cli/ with its
    modules (not __init__.py) and its sub-folders."""
    out = {}
    for package in PACKAGES:
        for folder in [ROOT / package, *sorted((ROOT / package).rglob("*/"))]:
            if not folder.is_dir() or folder.name == "__pycache__":
                continue
            names = {p.name for p in folder.iterdir() if p.suffix in MAPPED
                     and p.name != "__init__.py"}
            names |= {f"{p.name}/" for p in folder.iterdir() if p.is_dir()
                      and p.name != "__pycache__"}
            if names:
                out[f"{folder.relative_to(ROOT)}/"] = names
    return out


def test_readme_module_map_is_the_tree():
    listed, tree = readme_map(), tree_map()
    assert sorted(listed) == sorted(tree), "folders differ"
    for folder, names in tree.items():
        assert listed[folder] == names, (
            f"{folder}: missing {sorted(names - listed[folder])}, "
            f"gone {sorted(listed[folder] - names)}")
