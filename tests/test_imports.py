"""The package's import graph, read from its source: no cycle among module-level imports, no ``_private`` name
imported from another module, each layer importing only from the layers below it, and ``mvas/`` by role.

Edges are the imports a module runs when it is imported: those at module level, including inside ``try``/``if``
blocks, but not under ``if TYPE_CHECKING:`` and not inside functions (a function's import runs on call, after
every module has loaded, so it cannot be part of an import cycle). Importing ``macroarch.a.b`` also runs
``macroarch/a/__init__.py``; that edge counts unless ``a`` is a package the importer itself is in (it is already
loading). A ``_private`` name is a name with one leading underscore (dunders and ``__future__`` aside); importing it
from another module, anywhere in the file, couples the two modules to an implementation detail. A private
*module* (``macroarch.mvas._kernels``) may be imported from inside its parent package only.

**Layers** (``docs/design.md``, ``macroarch/__init__.py``): techniques < building blocks < measurement <
reproduction (``LAYERS``). Every import a module makes counts, wherever it is in the file (inside a function, under
``TYPE_CHECKING``, ``importlib.import_module("macroarch....")``): a harness in ``experiments`` that imports
``macroarch.repro`` on call still depends on the reproduction layer. **mvas/ by role**: codecs < _kernels < packed <
plan < interop < store and optim (``MVAS_ROLES``), for the imports a module runs when it is imported (the store
sits on top: a loader may build one on call, ``interop.checkpoint.load_packed``).

``python tests/test_imports.py`` prints every cycle, every private import and every upward import.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "macroarch"


@dataclass(frozen=True)
class PrivateImport:
    path: str
    line: int
    module: str  # the module imported from
    name: str  # the private name, or the private module's dotted name

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name} from {self.module}"


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``a/__init__.py`` is ``a``)."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return name in files and files[name].name == "__init__.py"


def _absolute(module: str | None, level: int, importer: str, files: dict[str, Path]) -> str:
    """``from .x import y`` in ``importer`` -> the absolute module name of ``.x``."""
    if not level:
        return module or ""
    base = importer.split(".")
    if not _is_package(importer, files):
        base = base[:-1]  # a module's relative imports start from its package
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements a module runs on import (into try/if/with blocks, not under TYPE_CHECKING)."""
    found = []
    for stmt in body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            found.append(stmt)
        elif isinstance(stmt, ast.If):
            if not _type_checking(stmt.test):
                found += _module_level(stmt.body)
            found += _module_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody, *[h.body for h in stmt.handlers]):
                found += _module_level(block)
        elif isinstance(stmt, ast.With):
            found += _module_level(stmt.body)
    return found


def _targets(stmt: ast.Import | ast.ImportFrom, importer: str, files: dict[str, Path]) -> list[str]:
    """The package's modules ``stmt`` imports (``from m import sub`` imports ``m.sub`` when that is a module)."""
    if isinstance(stmt, ast.Import):
        names = [alias.name for alias in stmt.names]
    else:
        base = _absolute(stmt.module, stmt.level, importer, files)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in stmt.names]
    out = []
    for name in names:
        parts = name.split(".")
        if parts[0] != PACKAGE:
            continue
        while parts and ".".join(parts) not in files:  # `import macroarch.a.b.name` -> the module part
            parts = parts[:-1]
        for cut in range(1, len(parts) + 1):  # the module and every package above it
            out.append(".".join(parts[:cut]))
    ancestors = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    return [t for t in dict.fromkeys(out) if t != importer and t not in ancestors]


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level."""
    files = module_files(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = {t for stmt in _module_level(tree.body) for t in _targets(stmt, name, files)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path that closes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the package's module count
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(component, graph) for component in sorted(components)]


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself, within the component."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    return paths[node] + [start]
                if succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    nxt.append(succ)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")


def private_imports(root: Path = ROOT, package: str = PACKAGE) -> list[PrivateImport]:
    """Every import of a ``_private`` name of one of the package's modules by another module (anywhere in a file),
    and of a private module from outside its parent package."""
    files = module_files(root, package)
    found = []
    for importer, path in files.items():
        rel = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = _absolute(node.module, node.level, importer, files)
                if base.split(".")[0] != package:
                    continue
                for alias in node.names:
                    dotted = f"{base}.{alias.name}"
                    if dotted in files:  # a submodule: private only if the module itself is private to its package
                        if not _may_import_module(importer, dotted):
                            found.append(PrivateImport(rel, node.lineno, base, dotted))
                    elif _private(alias.name):
                        found.append(PrivateImport(rel, node.lineno, base, alias.name))
                if not _may_import_module(importer, base):
                    found.append(PrivateImport(rel, node.lineno, base, base))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == package and not _may_import_module(importer, alias.name):
                        found.append(PrivateImport(rel, node.lineno, alias.name, alias.name))
    return sorted(set(found), key=lambda p: (p.path, p.line, p.name))


def _may_import_module(importer: str, module: str) -> bool:
    """A module path whose part ``_x`` is private may be imported from inside the package that holds ``_x``."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            parent = ".".join(parts[:i])
            if not (importer == parent or importer.startswith(parent + ".")):
                return False
    return True


# -- layers ----------------------------------------------------------------------------------------------------------
LAYERS = (  # lowest first; each top-level module or package of macroarch in exactly one (the top package, which
    # re-exports every layer's names lazily, is above them all)
    ("shared", ("_compat", "_progress", "_table", "_warnings", "_weak")),  # private infrastructure any layer may use
    ("techniques", ("dgr", "mvas", "optim", "comm", "compose", "config", "integrations", "paths", "layers")),
    ("building blocks", ("models", "data")),
    ("measurement", ("measure", "experiments", "planner")),
    ("reproduction", ("repro",)),
)


@dataclass(frozen=True)
class Upward:
    path: str
    line: int
    module: str  # the module imported
    importer_layer: str
    imported_layer: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module} ({self.importer_layer} imports {self.imported_layer})"


def layer_of(module: str, layers: tuple = LAYERS) -> int | None:
    """The rank of ``module``'s layer (0 lowest), None for the top package; a module in no layer is an error."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    for rank, (_, members) in enumerate(layers):
        if parts[1] in members:
            return rank
    raise AssertionError(f"{module} is in no layer: add {parts[1]!r} to LAYERS in tests/test_imports.py (and say "
                         "where it sits in docs/design.md)")


def all_imports(path: Path, importer: str, files: dict[str, Path]) -> list[tuple[int, str]]:
    """``(line, module)`` for every module of the package that ``path`` imports anywhere: import statements at any
    depth and under any condition, and ``importlib.import_module`` / ``__import__`` of a constant name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found += [(node.lineno, t) for t in _targets(node, importer, files)]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            value = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(value, str) and value.startswith(PACKAGE):
                stmt = ast.Import(names=[ast.alias(name=value)])
                found += [(node.lineno, t) for t in _targets(stmt, importer, files)]
    return found


def upward_imports(root: Path = ROOT, package: str = PACKAGE, layers: tuple = LAYERS) -> list[Upward]:
    """Every import of a module in a higher layer than the importer's (``layer_of``)."""
    files = module_files(root, package)
    names = [name for name, _ in layers]
    found = []
    for importer, path in files.items():
        low = layer_of(importer, layers)
        if low is None:
            continue
        for line, module in all_imports(path, importer, files):
            high = layer_of(module, layers)
            if high is not None and high > low:
                found.append(Upward(str(path.relative_to(root)), line, module, names[low], names[high]))
    return sorted(set(found), key=lambda u: (u.path, u.line, u.module))


MVAS_ROLES = (("codecs",), ("_kernels",), ("packed",), ("plan",), ("interop",), ("store", "optim"))
"""``macroarch.mvas``'s sub-packages and modules by role, lowest first (``macroarch/mvas/__init__.py``)."""


def role_violations(root: Path = ROOT, package: str = PACKAGE, roles: tuple = MVAS_ROLES) -> list[str]:
    """Module-level imports (``import_graph``) inside ``<package>.mvas`` of a higher role than the importer's."""
    mvas = f"{package}.mvas"

    def rank(module: str) -> int | None:
        parts = module.split(".")
        if parts[:2] != [package, "mvas"] or len(parts) < 3:
            return None  # the package itself (it re-exports every role) or outside mvas
        return next(i for i, members in enumerate(roles) if parts[2] in members)

    graph = import_graph(root, package)
    found = []
    for importer in sorted(m for m in graph if m.startswith(mvas + ".")):
        for module in sorted(graph[importer]):
            low, high = rank(importer), rank(module)
            if low is not None and high is not None and high > low:
                found.append(f"{importer} imports {module} ({'/'.join(roles[low])} below {'/'.join(roles[high])})")
    return found


def _report(title: str, lines: list[str]) -> str:
    mvas = [line for line in lines if "mvas" in line]
    return "\n".join([f"{title}: {len(lines)} ({len(mvas)} involve macroarch/mvas)", *[f"  {x}" for x in lines]])


# -- the package ---------------------------------------------------------------------------------------------------
def test_no_import_cycle():
    found = cycles(import_graph())
    lines = [" -> ".join(c) for c in found]
    print(_report("import cycles", lines))
    assert not found, _report("module-level import cycles (break each: move the shared piece down a layer)", lines)


def test_no_private_name_is_imported_across_modules():
    found = private_imports()
    lines = [str(p) for p in found]
    print(_report("private imports", lines))
    assert not found, _report("_private names imported from another module (make each public or move it)", lines)


def test_each_layer_imports_only_from_the_layers_below_it():
    """Importing ``macroarch.models.layers`` runs ``macroarch/models/__init__.py`` (every model builder): a technique
    that needs layer discovery depends on the building blocks unless discovery lives in the techniques' layer."""
    found = upward_imports()
    lines = [str(u) for u in found]
    print(_report("upward imports", lines))
    assert not found, _report("imports of a higher layer (move the shared piece down, or pass it in)", lines)


def test_every_module_has_a_layer():
    for module in module_files():
        layer_of(module)


def test_mvas_is_layered_by_role_with_store_and_optim_on_top():
    found = role_violations()
    print(_report("mvas role violations", found))
    assert not found, _report("mvas modules importing a higher role at import time (move the piece down)", found)


# -- the checks themselves, on a synthetic package -------------------------------------------------------------------
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return tmp_path


def test_a_cycle_is_found_and_printed_as_a_path(tmp_path):
    root = _package(tmp_path, {
        "macroarch/__init__.py": "",
        "macroarch/a.py": "from macroarch import b\n",
        "macroarch/b.py": "from macroarch.c import f\n",
        "macroarch/c.py": "import macroarch.a\ndef f():\n    pass\n",
        "macroarch/d.py": "def g():\n    from macroarch import a\n",  # on call: no edge
        "macroarch/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from macroarch import a\n",
    })
    graph = import_graph(root)
    assert graph["macroarch.d"] == set() and graph["macroarch.e"] == set()
    assert cycles(graph) == [["macroarch.a", "macroarch.b", "macroarch.c", "macroarch.a"]]


def test_a_package_init_is_an_edge_unless_the_importer_is_inside_it(tmp_path):
    root = _package(tmp_path, {
        "macroarch/__init__.py": "",
        "macroarch/p/__init__.py": "from macroarch.p.x import X\n",
        "macroarch/p/x.py": "from macroarch.q.y import Y\nX = 1\n",
        "macroarch/q/__init__.py": "from macroarch.p import X\n",
        "macroarch/q/y.py": "Y = 1\n",
    })
    graph = import_graph(root)
    assert "macroarch.p" not in graph["macroarch.p.x"]  # its own package is already loading
    assert graph["macroarch.p.x"] == {"macroarch.q", "macroarch.q.y"}
    assert cycles(graph) == [["macroarch.p", "macroarch.p.x", "macroarch.q", "macroarch.p"]]


def test_relative_imports_resolve(tmp_path):
    root = _package(tmp_path, {
        "macroarch/__init__.py": "",
        "macroarch/p/__init__.py": "from . import x\n",
        "macroarch/p/x.py": "from .y import _hidden\nfrom .. import q\n",
        "macroarch/p/y.py": "_hidden = 1\n",
        "macroarch/q.py": "",
    })
    graph = import_graph(root)
    assert graph["macroarch.p"] == {"macroarch.p.x"}
    assert graph["macroarch.p.x"] == {"macroarch.p.y", "macroarch.q"}
    assert [str(p) for p in private_imports(root)] == ["macroarch/p/x.py:1: _hidden from macroarch.p.y"]


@pytest.mark.parametrize("source, flagged", [
    ("from macroarch.m import _helper\n", ["_helper from macroarch.m"]),
    ("def f():\n    from macroarch.m import _helper\n", ["_helper from macroarch.m"]),  # anywhere in the file
    ("from macroarch.m import public, __version__\n", []),
    ("from __future__ import annotations\n", []),
    ("from macroarch._shim import thing\n", []),  # a private module of the top package: anyone inside may use it
    ("from macroarch.pkg._kernels import k\n", ["macroarch.pkg._kernels from macroarch.pkg._kernels"]),
    ("from macroarch.pkg import _kernels\n", ["macroarch.pkg._kernels from macroarch.pkg"]),
    ("import macroarch.pkg._kernels\n", ["macroarch.pkg._kernels from macroarch.pkg._kernels"]),
])
def test_private_imports_are_found(tmp_path, source, flagged):
    root = _package(tmp_path, {
        "macroarch/__init__.py": "__version__ = '0'\n",
        "macroarch/m.py": "_helper = public = 1\n",
        "macroarch/_shim.py": "thing = 1\n",
        "macroarch/pkg/__init__.py": "from macroarch.pkg._kernels import k\n",  # its own private module: allowed
        "macroarch/pkg/_kernels.py": "k = 1\n",
        "macroarch/user.py": source,
    })
    found = [f"{p.name} from {p.module}" for p in private_imports(root) if p.path == "macroarch/user.py"]
    assert found == flagged
    assert not [p for p in private_imports(root) if p.path != "macroarch/user.py"]


def test_an_upward_import_is_found_wherever_it_is(tmp_path):
    layers = (("low", ("a",)), ("high", ("b",)))
    root = _package(tmp_path, {
        "macroarch/__init__.py": "",
        "macroarch/a/__init__.py": "",
        "macroarch/a/x.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from macroarch.b import T\n"
                             "def f():\n    import macroarch.b.y\n"
                             "def g():\n    import importlib\n    return importlib.import_module('macroarch.b.y')\n"),
        "macroarch/a/ok.py": "from macroarch.a import x\n",
        "macroarch/b/__init__.py": "from macroarch.a import x\nT = 1\n",  # downward: fine
        "macroarch/b/y.py": "",
    })
    found = [(u.line, u.module) for u in upward_imports(root, layers=layers)]
    assert found == [(3, "macroarch.b"), (5, "macroarch.b"), (5, "macroarch.b.y"), (8, "macroarch.b"),
                     (8, "macroarch.b.y")]


def test_a_module_in_no_layer_is_named():
    with pytest.raises(AssertionError, match="macroarch.newthing.x is in no layer"):
        layer_of("macroarch.newthing.x")


def test_a_lower_role_importing_the_store_at_import_time_is_found(tmp_path):
    root = _package(tmp_path, {
        "macroarch/__init__.py": "",
        "macroarch/mvas/__init__.py": "from macroarch.mvas.store import S\n",  # the package re-exports: fine
        "macroarch/mvas/codecs/__init__.py": "",
        "macroarch/mvas/interop/__init__.py": "",
        "macroarch/mvas/interop/ck.py": ("from macroarch.mvas.codecs import f\nfrom macroarch.mvas.store import S\n"
                                         "def load():\n    from macroarch.mvas.store import S\n"),
        "macroarch/mvas/interop/ok.py": "def load():\n    from macroarch.mvas.store import S\n",  # on call
        "macroarch/mvas/store.py": "from macroarch.mvas.interop import ck\nS = 1\n",
    })
    assert role_violations(root, roles=(("codecs",), ("interop",), ("store",))) == [
        "macroarch.mvas.interop.ck imports macroarch.mvas.store (interop below store)"]


if __name__ == "__main__":
    graph = import_graph()
    print(_report("import cycles", [" -> ".join(c) for c in cycles(graph)]))
    print(_report("private imports", [str(p) for p in private_imports()]))
    print(_report("upward imports", [str(u) for u in upward_imports()]))
    print(_report("mvas role violations", role_violations()))
