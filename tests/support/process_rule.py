"""The process rule read from the source: which tests start a process, and whether they request ``processes``.

``tests.support.processes`` enforces the rule while a test runs, but only in the suites a run
collects: ``tests/deploy`` runs only under ``make deploy-test`` (it needs podman), ``tests/hosts``
needs root and network namespaces, and ``make test`` runs only the short versions of
``tests/faults``. This module checks those suites without running or even importing them, from
their syntax trees, so ``make test`` notices a test there that breaks the rule.

A test (or fixture) *starts a process* when its body, or a function or class it reaches,
calls one of :data:`STARTERS` (``subprocess.run``, ``os.fork``, ``asyncio.create_subprocess_exec``,
``multiprocessing.Process``, ...) outside a ``with processes.allowed():`` block (the session's
redis-server, which every test may use). "Reaches" follows the names the source resolves
statically: a function or class of the same module, one imported from this repository
(``tests``, ``bench``, ``backend``, ``kvpool``: read in turn), a method called on ``self``, and
the fixtures in the test's fixture closure. A class that is called (made) starts a process when
one of its methods, or of its base classes in this repository, does (``EmbeddedRedis()``,
``NodeProcess(...)``, ``HostBed(...)``). A method called on any other object is not followed:
the runtime check covers what this reading cannot see. The reading errs towards "starts" (a
class counts by any of its methods), which these three suites, all about processes, bear.

A test *requests* ``processes`` when that name is in its fixture closure: its parameters,
``usefixtures`` marks (on the test, its class, or the module's ``pytestmark``), and, from
fixture to fixture, the parameters of the fixtures visible to it (its module's, then each
``conftest.py`` from its folder up to ``tests/``).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from tests.support.processes import FIXTURE

__all__ = ["STARTERS", "SUITES", "Violation", "check", "starting_tests"]

SUITES = ("deploy", "hosts", "faults")  # the suites make test does not run in full

# Every door of the standard library to a new process (the ones tests.support.processes guards).
STARTERS: dict[str, frozenset[str]] = {
    "subprocess": frozenset({"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"}),
    "os": frozenset(
        {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "spawnl"}
        | {"execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe"}
    ),
    "asyncio": frozenset({"create_subprocess_exec", "create_subprocess_shell"}),
    "multiprocessing": frozenset({"Process", "Pool", "get_context"}),
    "pty": frozenset({"spawn", "fork"}),
}
OWN_PACKAGES = ("tests", "bench", "backend", "kvpool")  # read to follow a name imported from them

_Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


@dataclasses.dataclass(frozen=True)
class Violation:
    """A test that starts a process and does not request ``processes``."""

    test: str  # path::name, as pytest names it
    how: str  # the first process start found on its way

    def __str__(self) -> str:
        return f"{self.test} starts a process ({self.how}) but does not request the {FIXTURE!r} fixture"


class _Module:
    """One parsed module: its top-level definitions and what its names import."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.tree = ast.parse(path.read_text(), str(path))
        self.defs: dict[str, _Def] = {}
        self.imports: dict[str, tuple[str, str | None]] = {}  # local name -> (module, name in it or None)
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = (alias.name, None)
                    else:
                        top = alias.name.split(".")[0]
                        self.imports[top] = (top, None)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (node.module, alias.name)


class _Source:
    """The repository's modules, parsed on demand, and which of their definitions start a process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._modules: dict[str, _Module | None] = {}
        self._starts: dict[tuple[str, str], str] = {}  # (module, qualified name) -> how ("": it does not)

    def module(self, name: str) -> _Module | None:
        if name not in self._modules:
            found = None
            if name.split(".")[0] in OWN_PACKAGES:
                base = self.root.joinpath(*name.split("."))
                for path in (base.with_suffix(".py"), base / "__init__.py"):
                    if path.is_file():
                        found = _Module(name, path)
                        break
            self._modules[name] = found
        return self._modules[name]

    def module_at(self, path: Path) -> _Module:
        name = ".".join(path.relative_to(self.root).with_suffix("").parts)
        module = self.module(name)
        assert module is not None, path
        return module

    def resolve(self, module: _Module, name: str, depth: int = 0) -> tuple[_Module, _Def] | str | None:
        """What ``name`` is in ``module``: a definition of this repository, a starter ("subprocess.run"), or
        None (a value, or something outside the repository)."""
        if name in module.defs:
            return module, module.defs[name]
        if name not in module.imports or depth > 8:
            return None
        source, attr = module.imports[name]
        if attr is None:
            return None  # a module: attribute calls on it are resolved by _attribute
        if attr in STARTERS.get(source, ()):
            return f"{source}.{attr}"
        other = self.module(source)
        if other is None:
            return None
        return self.resolve(other, attr, depth + 1)

    def _attribute(
        self, module: _Module, call: ast.Attribute, cls: ast.ClassDef | None
    ) -> tuple[_Module, _Def] | str | None:
        """``mod.name`` or ``self.method``, resolved as :meth:`resolve` does."""
        if not isinstance(call.value, ast.Name):
            return None
        owner = call.value.id
        if owner == "self" and cls is not None:
            for item in cls.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == call.attr:
                    return module, item
            return None
        if owner in module.imports and module.imports[owner][1] is None:
            source = module.imports[owner][0]
        elif owner in module.imports:  # from package import submodule
            source = ".".join(filter(None, module.imports[owner]))
        else:
            return None
        if call.attr in STARTERS.get(source, ()):
            return f"{source}.{call.attr}"
        other = self.module(source)
        return None if other is None else self.resolve(other, call.attr)

    def starts(self, module: _Module, node: _Def, cls: ast.ClassDef | None = None) -> str:
        """How ``node`` starts a process ("" if it does not, as far as the source shows)."""
        key = (module.name, f"{cls.name}.{node.name}" if cls is not None else node.name)
        if key in self._starts:
            return self._starts[key]
        self._starts[key] = ""  # a cycle reads as "does not", until the walk says otherwise
        if isinstance(node, ast.ClassDef):
            how = self._class_starts(module, node)
        else:
            how = self._body_starts(module, node, cls)
        self._starts[key] = how
        return how

    def _class_starts(self, module: _Module, node: ast.ClassDef) -> str:
        """How a method of the class, or of a base class of this repository, starts a process."""
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                how = self.starts(module, item, node)
                if how:
                    return how
        for base in node.bases:
            target = self.resolve(module, base.id) if isinstance(base, ast.Name) else None
            if isinstance(target, tuple) and isinstance(target[1], ast.ClassDef):
                how = self.starts(*target)
                if how:
                    return f"{target[1].name} -> {how}"
        return ""

    def _body_starts(
        self, module: _Module, node: ast.FunctionDef | ast.AsyncFunctionDef, cls: ast.ClassDef | None
    ) -> str:
        nodes = list(_body_nodes(node))
        called = {id(sub.func) for sub in nodes if isinstance(sub, ast.Call)}
        for sub in nodes:
            target: tuple[_Module, _Def] | str | None = None
            on_self = False
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
                target = self._attribute(module, sub.func, cls)
                on_self = isinstance(sub.func.value, ast.Name) and sub.func.value.id == "self"
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                target = self.resolve(module, sub.id)  # a function called or handed on as a callback
                if isinstance(target, tuple) and isinstance(target[1], ast.ClassDef) and id(sub) not in called:
                    target = None  # a class named, not made
            if isinstance(target, str):
                return target
            if target is not None:
                where, definition = target
                how = self.starts(where, definition, cls if on_self else None)
                if how:
                    return f"{definition.name}() -> {how}"
        return ""


def _allowed_block(node: ast.AST) -> bool:
    """``with processes.allowed():``: the session's redis-server, started where any test may."""
    return isinstance(node, (ast.With, ast.AsyncWith)) and any(
        isinstance(item.context_expr, ast.Call)
        and isinstance(item.context_expr.func, (ast.Name, ast.Attribute))
        and (getattr(item.context_expr.func, "id", None) or getattr(item.context_expr.func, "attr", None)) == "allowed"
        for item in node.items
    )


def _body_nodes(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.AST]:
    """Every node of the body, annotations (naming a type starts nothing) and ``allowed()`` blocks left out."""
    stack: list[ast.AST] = list(node.body)
    while stack:
        sub = stack.pop()
        if _allowed_block(sub):
            continue
        yield sub
        for child in ast.iter_child_nodes(sub):
            if isinstance(sub, ast.AnnAssign) and child is sub.annotation:
                continue
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and child in sub.decorator_list:
                continue
            if isinstance(child, ast.arguments):
                continue
            stack.append(child)


def _is_fixture(node: _Def) -> str:
    """The fixture's name when ``node`` is a pytest fixture, else ""."""
    for decorator in node.decorator_list:
        call = decorator if isinstance(decorator, ast.Call) else None
        target = call.func if call is not None else decorator
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            for keyword in call.keywords if call is not None else []:
                if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                    return str(keyword.value.value)
            return node.name
    return ""


def _usefixtures(decorators: list[ast.expr]) -> list[str]:
    names: list[str] = []
    for decorator in decorators:
        if (
            isinstance(decorator, ast.Call)
            and isinstance(decorator.func, ast.Attribute)
            and decorator.func.attr == "usefixtures"
        ):
            names += [str(arg.value) for arg in decorator.args if isinstance(arg, ast.Constant)]
    return names


def _module_marks(module: _Module) -> list[str]:
    for node in module.tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            value = node.value
            marks = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
            return _usefixtures(list(marks))
    return []


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = node.args
    return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg not in ("self", "cls")]


class _Fixtures:
    """The fixtures a test module sees: its own, then each conftest's from its folder up to ``tests/``."""

    def __init__(self, source: _Source, module: _Module, tests_root: Path) -> None:
        self.source = source
        self.scopes: list[_Module] = [module]
        folder = module.path.parent
        while True:
            conftest = folder / "conftest.py"
            if conftest.is_file():
                self.scopes.append(source.module_at(conftest))
            if folder == tests_root or tests_root not in folder.parents:
                break
            folder = folder.parent

    def find(self, name: str, below: int = 0) -> tuple[int, _Module, ast.FunctionDef | ast.AsyncFunctionDef] | None:
        """The fixture ``name`` as seen from scope ``below`` on (a fixture that requests its own name
        gets the one it overrides)."""
        for index, scope in enumerate(self.scopes[below:], start=below):
            for node in scope.tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_fixture(node) == name:
                    return index, scope, node
        return None

    def closure(self, requested: list[str]) -> tuple[set[str], str]:
        """Every fixture name ``requested`` reaches, and how one of those fixtures starts a process ("")."""
        seen: set[str] = set()
        how = ""
        todo = [(name, 0) for name in requested]
        while todo:
            name, below = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            found = self.find(name, below)
            if found is None:
                continue  # pytest's own (tmp_path, monkeypatch, request) or a plugin's
            index, scope, node = found
            how = how or self.source.starts(scope, node)
            todo += [(param, index + 1 if param == name else index) for param in _params(node)]
            todo += [(param, index) for param in _usefixtures(node.decorator_list)]
        return seen, how


_Test = tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, ast.ClassDef | None, list[str]]


def _tests(module: _Module) -> Iterator[_Test]:
    """Each test of ``module``: its pytest name, node, class, and the fixtures its marks request."""
    module_marks = _module_marks(module)
    for node in module.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield node.name, node, None, module_marks + _usefixtures(node.decorator_list)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            class_marks = module_marks + _usefixtures(node.decorator_list)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    yield f"{node.name}::{item.name}", item, node, class_marks + _usefixtures(item.decorator_list)


def starting_tests(root: Path, folders: list[Path]) -> Iterator[tuple[str, str, bool]]:
    """Each test under ``folders`` that starts a process: its pytest id, how, and whether it requests
    ``processes``. ``root``: the repository (the folder holding ``tests/``)."""
    source = _Source(root)
    tests_root = root / "tests"
    for folder in folders:
        for path in sorted(folder.rglob("test_*.py")):
            module = source.module_at(path)
            fixtures = _Fixtures(source, module, tests_root)
            for name, node, cls, marks in _tests(module):
                closure, fixture_how = fixtures.closure(_params(node) + marks)
                how = source.starts(module, node, cls) or fixture_how
                if how:
                    yield f"{path.relative_to(root)}::{name}", how, FIXTURE in closure


def check(root: Path, folders: list[Path]) -> list[Violation]:
    """The tests under ``folders`` that start a process without requesting ``processes``."""
    return [Violation(test, how) for test, how, declared in starting_tests(root, folders) if not declared]
