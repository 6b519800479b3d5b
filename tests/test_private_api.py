"""Every private torch name the package touches, found by reading its source; any outside ``macroarch/_compat`` fails.

A private name is any part of a dotted torch path that starts with ``_`` and is not a dunder: ``torch._C.x``,
``from torch.utils._pytree import ...``, ``import torch._dynamo``, ``torch.ops.mkldnn._x``, a ``getattr(torch.x,
"_y")`` (with the name a string constant, or a loop variable over string constants), ``importlib.import_module(
"torch._x")``, and, in a class that subclasses a torch class, a method that overrides a private member of its base
or a ``self._x``/``super()._x`` that reads one. Aliases are followed (``import torch.nn.functional as F``, ``from
torch.distributed import fsdp``). What the scan cannot see: private attributes of objects it cannot trace to torch
(``tensor._base`` on a local).

``python tests/test_private_api.py`` prints the inventory: each shim with what it covers, and every hit outside.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "macroarch"
SHIMS = PACKAGE / "_compat"


@dataclass(frozen=True)
class Hit:
    path: str  # relative to the checkout
    line: int
    name: str  # the dotted torch name touched

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name}"


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _is_private_path(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(_private(p) for p in parts[1:])


class _Scanner(ast.NodeVisitor):
    """One module's private torch names. Aliases are tracked per module (not per scope: a function's local
    ``import torch._x as y`` is reported where it is imported, and its later uses resolve too)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}  # local name -> dotted torch path
        self.hits: list[Hit] = []
        self.objects: set[str] = set()  # every torch path the module refers to
        self.strings: list[tuple[ast.Constant, str]] = []  # string constants that look like private names
        self._scopes: list[ast.AST] = []
        self._classes: list[tuple[ast.ClassDef, list[type]]] = []  # enclosing classes with their torch bases

    def _hit(self, node: ast.AST, name: str) -> None:
        self.hits.append(Hit(self.path, node.lineno, name))

    # -- imports -----------------------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != "torch":
                continue
            if _is_private_path(alias.name):
                self._hit(node, alias.name)
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                self.aliases["torch"] = "torch"
            self.objects.add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or node.module.split(".")[0] != "torch":
            return
        for alias in node.names:
            dotted = f"{node.module}.{alias.name}"
            if _is_private_path(dotted):
                self._hit(node, dotted)
            self.aliases[alias.asname or alias.name] = dotted

    # -- names ---------------------------------------------------------------------------------------------------
    def _dotted(self, node: ast.AST) -> str | None:
        """``torch.a.b`` for an attribute chain whose root is a name bound to torch (or to a path inside it)."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return ".".join([self.aliases[node.id], *reversed(parts)])
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = self._dotted(node)
        if dotted is not None:
            self.objects.add(dotted)
            if _is_private_path(dotted):
                self._hit(node, dotted)
            return  # the inner parts of the chain are the same name
        self._check_self_attribute(node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        by_name = ("getattr", "hasattr", "setattr", "delattr")
        if isinstance(func, ast.Name) and func.id in by_name and len(node.args) >= 2:
            owner = self._dotted(node.args[0])
            names = self._strings(node.args[1]) if owner is not None else []
            if names:  # the attribute by name is the one reported, not its owner alone
                self.objects.add(owner)
                for name in names:
                    if _is_private_path(f"{owner}.{name}"):
                        self._hit(node, f"{owner}.{name}")
                for arg in [*node.args[1:], *node.keywords]:
                    self.visit(arg)
                return
        callee = self._callee(func)
        if callee in ("importlib.import_module", "__import__") and node.args:
            for name in self._strings(node.args[0]):
                if _is_private_path(name):
                    self._hit(node, name)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and _private(node.value) and node.value.isidentifier():
            self.strings.append((node, node.value))

    def names_by_string(self) -> None:
        """A private attribute named by a string constant anywhere in the module (a helper's ``getattr(owner,
        name)`` with the name passed in) is reported if a torch object the module refers to has it."""
        reported = {h.name.rsplit(".", 1)[-1] for h in self.hits}
        for node, name in self.strings:
            if name in reported:
                continue
            for owner in sorted(self.objects):
                if _has(owner, name):
                    self._hit(node, f"{owner}.{name} (by name)")

    def _callee(self, func: ast.AST) -> str | None:
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            return f"{func.value.id}.{func.attr}"
        return None

    def _strings(self, node: ast.AST) -> list[str]:
        """The string constants ``node`` can be: a constant, or a name that a ``for`` loop, comprehension or
        assignment in the innermost enclosing function (or class, or module) binds to string constants."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if not isinstance(node, ast.Name):
            return []
        found = []
        for scope in self._scopes[-1:]:
            for sub in ast.walk(scope):
                target = value = None
                if isinstance(sub, ast.For | ast.comprehension):
                    target, value = sub.target, sub.iter
                elif isinstance(sub, ast.Assign) and len(sub.targets) == 1:
                    target, value = sub.targets[0], sub.value
                if isinstance(target, ast.Name) and target.id == node.id and value is not None:
                    found += [c.value for c in ast.walk(value)
                              if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        return found

    # -- subclasses of torch classes -------------------------------------------------------------------------------
    def _torch_bases(self, node: ast.ClassDef) -> list[type]:
        bases = []
        for base in node.bases:
            dotted = self._dotted(base)
            if dotted is None:
                continue
            obj = _resolve(dotted)
            if isinstance(obj, type):
                bases.append(obj)
        return bases

    def _check_self_attribute(self, node: ast.Attribute) -> None:
        if not self._classes or not _private(node.attr):
            return
        _, bases = self._classes[-1]
        value = node.value
        is_self = isinstance(value, ast.Name) and value.id in ("self", "cls")
        is_super = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"
        if (is_self or is_super) and any(hasattr(b, node.attr) or _instance_attribute(b, node.attr) for b in bases):
            self._hit(node, f"{_qualname(bases, node.attr)}")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = self._torch_bases(node)
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and _private(stmt.name):
                if any(hasattr(b, stmt.name) for b in bases):
                    self._hit(stmt, f"{_qualname(bases, stmt.name)} (overridden)")
        self._classes.append((node, bases))
        self._scopes.append(node)
        self.generic_visit(node)
        self._scopes.pop()
        self._classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scopes.append(node)
        self.generic_visit(node)
        self._scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Module(self, node: ast.Module) -> None:
        self._scopes.append(node)
        self.generic_visit(node)
        self._scopes.pop()


def _has(dotted: str, name: str) -> bool:
    obj = _resolve(dotted)
    if obj is None:
        return False
    try:
        return hasattr(obj, name)
    except Exception:  # torch.ops namespaces look ops up on access
        return False


@functools.cache
def _resolve(dotted: str) -> object | None:
    """The object a dotted torch path names, importing what it must; None if it does not exist here."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def _instance_attribute(cls: type, name: str) -> bool:
    """Whether ``__init__`` in the source of ``cls`` (or a base) assigns ``self.<name>``: attributes that exist only
    on instances. Read from each class's source file, not from ``klass.__init__``: torch.compile replaces
    ``nn.Module.__init__`` with a wrapper of its own (dynamo's generation tagging), whose source says nothing."""
    return any(re.search(rf"self\.{re.escape(name)}\b\s*(:[^=]*)?=|[\'\"]{re.escape(name)}[\'\"]", source)
               for source in map(_init_source, cls.__mro__))  # ``super().__setattr__("x", ...)`` as nn.Module does


@functools.cache
def _init_source(klass: type) -> str:
    """The source text of the ``__init__`` written in ``klass``'s own class body, or "" where there is none."""
    import inspect

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return ""
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            return ast.unparse(stmt)
    return ""


def _qualname(bases: list[type], name: str) -> str:
    owner = next((b for b in bases if hasattr(b, name) or _instance_attribute(b, name)), bases[0])
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def scan_source(source: str, path: str = "<source>") -> list[Hit]:
    """The private torch names one module's source touches, in line order (a name once per line)."""
    scanner = _Scanner(path)
    scanner.visit(ast.parse(source, filename=path))
    scanner.names_by_string()
    seen, hits = set(), []
    for hit in sorted(scanner.hits, key=lambda h: (h.line, h.name)):
        if (hit.line, hit.name) not in seen:
            seen.add((hit.line, hit.name))
            hits.append(hit)
    return hits


def scan_package() -> list[Hit]:
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        hits += scan_source(path.read_text(), str(path.relative_to(ROOT)))
    return hits


def _in_shims(hit: Hit) -> bool:
    return Path(ROOT / hit.path).is_relative_to(SHIMS)


def inventory(hits: list[Hit]) -> str:
    """The shims, each with its first docstring line and the private names it covers; then every hit outside."""
    lines = ["Shims in macroarch/_compat:"]
    by_shim: dict[str, set[str]] = defaultdict(set)
    for hit in hits:
        if _in_shims(hit):
            by_shim[hit.path].add(hit.name)
    for path in sorted(SHIMS.glob("*.py")):
        rel = str(path.relative_to(ROOT))
        doc = (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n")[0]
        lines.append(f"  {rel}: {doc}")
        lines += [f"      {name}" for name in sorted(by_shim.get(rel, ()))]
    outside = [h for h in hits if not _in_shims(h)]
    by_dir: dict[str, list[Hit]] = defaultdict(list)
    for hit in outside:
        parts = Path(hit.path).parts
        by_dir["/".join(parts[:2]) if len(parts) > 2 else hit.path].append(hit)
    lines.append(f"Private torch names outside the shims: {len(outside)}")
    for where, group in sorted(by_dir.items()):
        files = len({h.path for h in group})
        lines.append(f"  {where}: {len(group)} in {files} files")
        lines += [f"    {h}" for h in group]
    return "\n".join(lines)


# -- the package ---------------------------------------------------------------------------------------------------
def test_private_torch_names_live_only_in_the_shims():
    hits = scan_package()
    report = inventory(hits)
    print(report)
    outside = [h for h in hits if not _in_shims(h)]
    assert not outside, "private torch names outside macroarch/_compat (move each into a shim there):\n" + report


def test_shims_declare_the_packages_torch_range():
    """The range the shims guard against is the one pyproject.toml declares."""
    import tomllib

    from macroarch._compat import version

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if re.match(r"torch\b", d)]
    m = re.fullmatch(r"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)", torch_dep.replace(" ", ""))
    assert m, f"pyproject's torch dependency {torch_dep!r} is not a '>=X.Y,<X.Z' range"
    a, b, c, d = map(int, m.groups())
    assert (version.OLDEST, version.FIRST_UNTESTED) == ((a, b), (c, d)), torch_dep


# -- the scanner itself, on synthetic source -------------------------------------------------------------------------
def _names(source: str) -> list[str]:
    return [h.name for h in scan_source(source)]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import torch\ntorch._C._current_graph_task_id()", ["torch._C._current_graph_task_id"]),
        ("import torch\nx = torch.ops.mkldnn._is_mkldnn_bf16_supported()",
         ["torch.ops.mkldnn._is_mkldnn_bf16_supported"]),
        ("from torch._subclasses.fake_tensor import FakeTensorMode", ["torch._subclasses.fake_tensor.FakeTensorMode"]),
        ("from torch.utils import _pytree as pytree\npytree.tree_flatten(1)",
         ["torch.utils._pytree", "torch.utils._pytree.tree_flatten"]),
        ("import torch._dynamo", ["torch._dynamo"]),
        ("import torch._inductor.config as cfg\ncfg.x = 1", ["torch._inductor.config", "torch._inductor.config.x"]),
        ("from torch.distributed._tools.mem_tracker import _TOTAL_KEY",
         ["torch.distributed._tools.mem_tracker._TOTAL_KEY"]),
        ("from torch.nn import functional as F\nF._canonical_mask(1)", ["torch.nn.functional._canonical_mask"]),
        ("import torch as T\nT.Tensor._make_subclass", ["torch.Tensor._make_subclass"]),
        ("import torch\ngetattr(torch.cpu, '_is_avx512_bf16_supported')", ["torch.cpu._is_avx512_bf16_supported"]),
        ("import torch\nfor n in ('_is_amx_tile_supported', 'ok'):\n    getattr(torch.cpu, n, None)",
         ["torch.cpu._is_amx_tile_supported"]),
        ("import importlib\nimportlib.import_module('torch._inductor.codecache')", ["torch._inductor.codecache"]),
        ("import torch\ngetattr(torch._C, 'DisableTorchFunctionSubclass', None)",
         ["torch._C.DisableTorchFunctionSubclass"]),
        ("import torch\ndef probe(owner, name):\n    return getattr(owner, name)()\n"
         "probe(torch.cpu, '_is_amx_tile_supported')",
         ["torch.cpu._is_amx_tile_supported (by name)"]),
        ("def f():\n    from torch._C import _nn\n    return _nn.linear", ["torch._C._nn", "torch._C._nn.linear"]),
        ("import torch\nclass M(torch.nn.Module):\n    def f(self):\n        return self._parameters",
         ["torch.nn.modules.module.Module._parameters"]),
        ("import torch\nclass M(torch.nn.Module):\n    def _apply(self, fn):\n        return super()._apply(fn)",
         ["torch.nn.modules.module.Module._apply (overridden)", "torch.nn.modules.module.Module._apply"]),
    ],
)
def test_the_scanner_finds_private_names(source, expected):
    assert _names(source) == expected


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.nn.functional.linear(1, 2)",
        "import torch\nx = torch.Tensor.__torch_dispatch__",  # a dunder is public protocol
        "import torch\ngetattr(torch, name)",  # a name the scan cannot know is not reported
        "import torch\nfor n in ('float32', 'bfloat16'):\n    getattr(torch, n)",
        "class M:\n    def _apply(self):\n        return self._x",  # not a torch class
        "import torch\nclass M(torch.nn.Module):\n    def _mine(self):\n        return self._own",
        "import numpy as np\nnp._core",  # not torch
        "from macroarch._compat.autograd import backward_pass_id",
        "import torch\nSUFFIX = '_packed'\nx = torch.cpu",  # a private-looking string no torch object has
    ],
)
def test_the_scanner_passes_public_use(source):
    assert _names(source) == []


def test_the_scanner_reads_init_from_source_after_torch_compile_wraps_it(monkeypatch):
    """torch.compile replaces ``nn.Module.__init__`` with dynamo's tagging wrapper for the rest of the process (the
    whole suite ran with it, and CI found ``self._parameters`` unreported): attributes set only in ``__init__``
    are still found."""
    import torch

    init = torch.nn.Module.__init__

    def patched_init(self, *args, **kwargs):  # what torch/_dynamo/mutation_guard.py installs: no functools.wraps
        init(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__init__", patched_init)
    source = "import torch\nclass M(torch.nn.Module):\n    def f(self):\n        return self._buffers"
    assert _names(source) == ["torch.nn.modules.module.Module._buffers"]


def test_a_new_private_name_fails_the_package_test(tmp_path, monkeypatch):
    """A module outside the shims that touches one private name makes the package test fail."""
    package = tmp_path / "macroarch"
    (package / "_compat").mkdir(parents=True)
    (package / "_compat" / "ok.py").write_text('"""A shim."""\nimport torch\ntorch._C._get_tracing_state()\n')
    (package / "new.py").write_text("import torch\nx = torch._foreach_add\n")
    for name, value in (("ROOT", tmp_path), ("PACKAGE", package), ("SHIMS", package / "_compat")):
        monkeypatch.setitem(globals(), name, value)
    with pytest.raises(AssertionError, match=r"macroarch/new.py:2: torch._foreach_add"):
        test_private_torch_names_live_only_in_the_shims()


if __name__ == "__main__":
    print(inventory(scan_package()))
