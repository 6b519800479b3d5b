"""Every private torch name the package touches, found by reading its source; any outside ``macroarch/_compat`` fails.

A private name is any part of a dotted torch path that starts with ``_`` and is not a dunder: ``torch._C.x``,
``from torch.utils._pytree import ...``, ``import torch._dynamo``, ``torch.ops.mkldnn._x``, a ``getattr(torch.x,
"_y")`` (with the name a string constant, or a loop variable over string constants), ``importlib.import_module(
"torch._x")``, and, in a class that subclasses a torch class, a method that overrides a private member of its base
or a ``self._x``/``super()._x`` that reads one. Aliases are followed: imports (``import torch.nn.functional as F``,
``from torch.distributed import fsdp``) and assignments (``aten = torch.ops.aten``, wherever in the module).

Objects the scan cannot trace to torch (a function's argument, ``ddp.reducer``, ``t.grad_fn``) are caught by the
name of the attribute: ``x._y`` or ``getattr(x, "_y")`` is reported when ``_y`` is a private attribute of one of
torch's classes (``torch_private_attributes``: read from the classes of torch's public modules, their members and
what their methods assign to ``self``: ``Module._parameters``, ``TensorBase._base``, ``Reducer._get_zeros_like_...``)
and the package does not define ``_y`` on a class of its own (``own_attributes``; a name both define is taken as
the package's, the limit of reading source without types).

``python tests/test_private_api.py`` prints the inventory: each shim with what it covers, and every hit outside.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "macroarch"
SHIMS = PACKAGE / "_compat"

# torch's public modules whose classes' instances the package handles, often without naming the class (a module
# passed in, a gradient's ``grad_fn``, DDP's ``reducer``); their classes and every base of those in torch are read
TORCH_MODULES = ("torch", "torch.nn", "torch.nn.parallel", "torch.optim", "torch.autograd", "torch.autograd.graph",
                 "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.utils.data",
                 "torch.utils.hooks", "torch.fx", "torch.amp", "torch.nn.utils.parametrize", "torch.cuda")


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


def _dotted_in(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``torch.a.b`` for an attribute chain whose root is a name bound to torch (or to a path inside it)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def torch_aliases(tree: ast.AST) -> dict[str, str]:
    """Every name the module binds to torch or a path inside it: by import, or by assignment from such a path
    (``aten = torch.ops.aten``; ``ops = torch.ops`` then ``aten = ops.aten``), in any scope and in any order."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    aliases[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    assignments = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    assignments += zip(target.elts, node.value.elts)
                else:
                    assignments.append((target, node.value))
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
            assignments.append((node.target, node.value))
    changed = True
    while changed:  # an alias may be assigned from one assigned further down
        changed = False
        for target, value in assignments:
            dotted = _dotted_in(value, aliases)
            if isinstance(target, ast.Name) and dotted is not None and aliases.get(target.id) != dotted:
                aliases[target.id] = dotted
                changed = True
    return aliases


class _Scanner(ast.NodeVisitor):
    """One module's private torch names. Aliases are per module (``torch_aliases``: not per scope)."""

    def __init__(self, path: str, aliases: dict[str, str], own: frozenset[str]) -> None:
        self.path = path
        self.aliases = aliases  # local name -> dotted torch path
        self.own = own  # private attribute names the package defines on its own classes
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
            self.objects.add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or node.module.split(".")[0] != "torch":
            return
        for alias in node.names:
            dotted = f"{node.module}.{alias.name}"
            if _is_private_path(dotted):
                self._hit(node, dotted)

    # -- names ---------------------------------------------------------------------------------------------------
    def _dotted(self, node: ast.AST) -> str | None:
        return _dotted_in(node, self.aliases)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = self._dotted(node)
        if dotted is not None:
            self.objects.add(dotted)
            if _is_private_path(dotted):
                self._hit(node, dotted)
            return  # the inner parts of the chain are the same name
        if not self._check_self_attribute(node):
            self._check_object_attribute(node, node.attr)
        self.generic_visit(node)

    def _check_object_attribute(self, node: ast.AST, name: str) -> None:
        """``x._y`` on an object not traced to torch: reported if ``_y`` is torch's and not the package's own."""
        owner = torch_private_attributes().get(name)
        if owner is not None and name not in self.own:
            self._hit(node, f"{owner}.{name}")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        by_name = ("getattr", "hasattr", "setattr", "delattr")
        if isinstance(func, ast.Name) and func.id in by_name and len(node.args) >= 2:
            owner = self._dotted(node.args[0])
            names = self._strings(node.args[1])
            if names and owner is not None:  # the attribute by name is the one reported, not its owner alone
                self.objects.add(owner)
                for name in names:
                    if _is_private_path(f"{owner}.{name}"):
                        self._hit(node, f"{owner}.{name}")
                for arg in [*node.args[1:], *node.keywords]:
                    self.visit(arg)
                return
            for name in names:  # on an object not traced to torch
                self._check_object_attribute(node, name)
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
        return torch_bases(node, self.aliases)

    def _check_self_attribute(self, node: ast.Attribute) -> bool:
        """``self._x`` / ``super()._x`` in a class whose torch base has ``_x``: reported (True). False for any other
        attribute (``_check_object_attribute`` then decides: a class of the package may derive from torch's
        through another of its own)."""
        value = node.value
        is_self = isinstance(value, ast.Name) and value.id in ("self", "cls")
        is_super = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"
        if not (is_self or is_super) or not self._classes or not _private(node.attr):
            return False
        _, bases = self._classes[-1]
        if any(hasattr(b, node.attr) or _instance_attribute(b, node.attr) for b in bases):
            self._hit(node, f"{_qualname(bases, node.attr)}")
            return True
        return False

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


def torch_bases(node: ast.ClassDef, aliases: dict[str, str]) -> list[type]:
    """The torch classes among a class statement's bases."""
    bases = []
    for base in node.bases:
        dotted = _dotted_in(base, aliases)
        obj = None if dotted is None else _resolve(dotted)
        if isinstance(obj, type):
            bases.append(obj)
    return bases


def _defined_attributes(klass: ast.ClassDef) -> set[str]:
    """The attributes a class statement defines: its methods and class attributes, ``__slots__``, and whatever its
    methods assign to ``self.<name>`` / ``cls.<name>`` or through ``__setattr__("<name>", ...)``."""
    names = set()
    for stmt in klass.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(stmt.name)
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(
            stmt, ast.AnnAssign) else []
        names.update(t.id for t in targets if isinstance(t, ast.Name))
        if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
            names.update(c.value for c in ast.walk(stmt.value) if isinstance(c, ast.Constant)
                         and isinstance(c.value, str))
    for node in ast.walk(klass):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__setattr__"
              and node.args):
            first = node.args[1] if len(node.args) > 2 else node.args[0]  # object.__setattr__(self, "x", v)
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value)
    return names


def own_attributes(sources: Iterable[str]) -> frozenset[str]:
    """The private attribute names the package defines on its own classes: ``_defined_attributes`` of each, less
    those that a torch base of that class has (an override of torch's member is torch's name, not the package's)."""
    own = set()
    for source in sources:
        tree = ast.parse(source)
        aliases = torch_aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = torch_bases(node, aliases)
                own.update(name for name in _defined_attributes(node) if _private(name) and not any(
                    hasattr(b, name) or _instance_attribute(b, name) for b in bases))
    return frozenset(own)


@functools.cache
def torch_private_attributes() -> dict[str, str]:
    """Private attribute name -> the torch class it belongs to (``module.qualname``), for every class of
    ``TORCH_MODULES`` and every base of those in torch: the names in each class's ``__dict__`` (C++ methods such as
    ``Reducer._get_zeros_like_grad_buckets`` and ``Node._sequence_nr`` included) and the attributes its methods
    assign to ``self`` (``Module._parameters``). Where several classes have a name, the one nearest the root of
    its hierarchy is named (the base most of them derive from: ``TensorBase._base``, not ``ByteTensor._base``)."""
    import warnings

    classes: set[type] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated aliases warn when read (torch.distributed.reduce_op)
        for name in TORCH_MODULES:
            module = importlib.import_module(name)
            for attr in dir(module):
                try:
                    obj = getattr(module, attr)
                except Exception:  # a lazily imported submodule that fails here is no class of ours
                    continue
                if isinstance(obj, type):
                    classes.update(k for k in obj.__mro__ if (k.__module__ or "").split(".")[0] == "torch")
    below = {k: sum(k in c.__mro__ for c in classes) for k in classes}  # how many of the classes derive from k
    found: dict[str, str] = {}
    for klass in sorted(classes, key=lambda k: (-below[k], k.__module__, k.__qualname__)):
        tree = _class_tree(klass)
        names = set(vars(klass)) | (_defined_attributes(tree) if tree is not None else set())
        for name in sorted(names):
            if _private(name):
                found.setdefault(name, f"{klass.__module__}.{klass.__qualname__}")
    return found


def _class_tree(klass: type) -> ast.ClassDef | None:
    """The class statement of ``klass`` in its source file; None for a class without Python source."""
    try:
        path = inspect.getsourcefile(klass)
    except TypeError:  # a builtin (C++) class
        return None
    return None if path is None else _classes_in(path).get(klass.__qualname__)


@functools.cache
def _classes_in(path: str) -> dict[str, ast.ClassDef]:
    """Qualified name -> class statement, for every class of a source file (parsed once: ``inspect.getsource``
    parses the whole file again for each class)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}
    found: dict[str, ast.ClassDef] = {}

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                found[prefix + stmt.name] = stmt
                walk(stmt.body, f"{prefix}{stmt.name}.")
            elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                walk(stmt.body, f"{prefix}{stmt.name}.<locals>.")
            elif isinstance(stmt, ast.If | ast.Try):  # classes defined under a version or import check
                walk([*stmt.body, *stmt.orelse, *getattr(stmt, "finalbody", [])], prefix)
                for handler in getattr(stmt, "handlers", []):
                    walk(handler.body, prefix)

    walk(tree.body, "")
    return found


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


def _init_source(klass: type) -> str:
    """The source text of the ``__init__`` written in ``klass``'s own class body, or "" where there is none."""
    tree = _class_tree(klass)
    for stmt in [] if tree is None else tree.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            return ast.unparse(stmt)
    return ""


def _qualname(bases: list[type], name: str) -> str:
    owner = next((b for b in bases if hasattr(b, name) or _instance_attribute(b, name)), bases[0])
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def scan_source(source: str, path: str = "<source>", own: frozenset[str] | None = None) -> list[Hit]:
    """The private torch names one module's source touches, in line order (a name once per line). ``own``: the
    private attribute names the package defines (``own_attributes``); default, those this source defines."""
    tree = ast.parse(source, filename=path)
    scanner = _Scanner(path, torch_aliases(tree), own_attributes([source]) if own is None else own)
    scanner.visit(tree)
    scanner.names_by_string()
    seen, hits = set(), []
    for hit in sorted(scanner.hits, key=lambda h: (h.line, h.name)):
        if (hit.line, hit.name) not in seen:
            seen.add((hit.line, hit.name))
            hits.append(hit)
    return hits


def scan_package() -> list[Hit]:
    sources = {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    own = own_attributes(sources.values())
    hits = []
    for path, source in sources.items():
        hits += scan_source(source, str(path.relative_to(ROOT)), own)
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
        # aliases by assignment, before or after their use, and chained
        ("import torch\naten = torch.ops.aten\nOPS = {aten._unsafe_view.default, aten.view.default}",
         ["torch.ops.aten._unsafe_view.default"]),
        ("import torch\ndef f(func):\n    return func is aten._to_copy.default\naten = ops.aten\nops = torch.ops",
         ["torch.ops.aten._to_copy.default"]),
        ("from torch import ops\naten, c = ops.aten, 1\naten._unsafe_view", ["torch.ops.aten._unsafe_view"]),
        # private attributes of torch's classes, on objects the scan cannot trace to torch
        ("def tensors(module):\n    return module._parameters, module._buffers",
         ["torch.nn.modules.module.Module._buffers", "torch.nn.modules.module.Module._parameters"]),
        ("def buckets(ddp):\n    return ddp.reducer._get_zeros_like_grad_buckets()",
         ["torch._C._distributed_c10d.Reducer._get_zeros_like_grad_buckets"]),
        ("def order(t):\n    return t.grad_fn._sequence_nr()", ["torch._C._FunctionBase._sequence_nr"]),
        ("def is_view(t):\n    return t._base is not None", ["torch._C.TensorBase._base"]),
        ("def shard(p):\n    return getattr(p, '_local_tensor', p)",
         ["torch.distributed.tensor.DTensor._local_tensor"]),
        ("class Helper:\n    def f(self, module):\n        return self._parameters",
         ["torch.nn.modules.module.Module._parameters"]),
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
        "def f(weight):\n    return weight._views",  # a private name no torch class has
        # a name torch's classes have that the package defines on a class of its own is taken as the package's
        "class Store:\n    def __init__(self):\n        self._version = 0\ndef f(store):\n    return store._version",
        "import torch\nx = torch.float32\ndef f(x):\n    return x.is_floating_point",
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


def test_the_private_attributes_are_read_from_torchs_classes():
    """Derived, not listed: the names of the audit's misses are found, each with the class it belongs to, and an
    attribute that is not private is not."""
    import torch

    names = torch_private_attributes()
    assert names["_parameters"] == "torch.nn.modules.module.Module"  # assigned in Module.__init__
    assert names["_base"] == "torch._C.TensorBase"  # a C++ attribute
    assert names["_sequence_nr"] == "torch._C._FunctionBase"  # every autograd node's (grad_fn) C++ base
    assert "_get_zeros_like_grad_buckets" in names and "reducer" not in names
    assert all(_private(n) for n in names)
    assert hasattr(torch.ones(1), "_version") and "_version" in names


def test_the_package_defines_its_own_names():
    """A class's own private attributes are the package's; an override of its torch base's is not."""
    source = ("import torch\nclass W(torch.Tensor):\n    def _derived(self):\n        self._dtype = 1\n"
              "    def _make_subclass(self):\n        pass\n")
    own = own_attributes([source])
    assert {"_derived", "_dtype"} <= own and "_make_subclass" not in own


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
