"""rltk's builtin components read from their source: what each registration hook returns, and each component's
signature, annotations, docstring and class attributes, without importing the module (which imports torch).

Everything here is exact or nothing. A reading that would need to run code (a decorator other than a
:class:`rltk.ComponentTable`'s ``register``, a default that is not a literal, a base class outside rltk, a
metaclass, a hook that returns anything but a table or a ``{"name": Name}`` literal) gives ``None``, and
the registry imports the real module instead. ``tests/test_builtin_registrations_from_source.py`` compares
every builtin's reading with the imported object, so a module that the reader gets wrong fails there.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the folder of the rltk package
_MAX_DEPTH = 8  # re-exports and base classes followed across modules


class NotExact(Exception):
    """The source alone cannot say what the imported object would: import it instead."""


# ---------------------------------------------------------------- a module's top-level bindings

@dataclass
class Module:
    name: str
    tree: ast.Module
    future_annotations: bool
    bindings: dict[str, ast.stmt | None]  # None: bound in a way the reader does not follow (try, if, loop...)
    attribute_assigns: dict[str, set[str]] = field(default_factory=dict)  # name -> attributes set at top level


def _path_of(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != "rltk":
        return None
    base = PACKAGE_ROOT.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _bound_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | {
        (a.asname or a.name).split(".")[0] for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names} | {n.name for n in ast.walk(node)
                             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _bind(bindings: dict, name: str, node: ast.stmt | None) -> None:
    bindings[name] = None if name in bindings else node  # bound twice: which one holds depends on running it


@lru_cache(maxsize=None)
def _parse(module: str, stamp: tuple) -> Module | None:
    path = _path_of(module)
    tree = ast.parse(path.read_text(), str(path))
    bindings: dict[str, ast.stmt | None] = {}
    attrs: dict[str, set[str]] = {}
    future = False
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            future = future or any(a.name == "annotations" for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _bind(bindings, node.name, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                _bind(bindings, (alias.asname or alias.name).split(".")[0], node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and (isinstance(node, ast.Assign) or node.value is not None):
                    _bind(bindings, target.id, node)
                elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    attrs.setdefault(target.value.id, set()).add(target.attr)
                else:
                    for name in _bound_names(target):
                        _bind(bindings, name, None)
        elif _is_type_checking(node):
            continue
        else:
            for name in _bound_names(node):
                _bind(bindings, name, None)
    return Module(module, tree, future, bindings, attrs)


def parse_module(module: str) -> Module | None:
    path = _path_of(module)
    if path is None:
        return None
    stat = path.stat()
    return _parse(module, (str(path), stat.st_mtime_ns, stat.st_size))


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.name.split(".")
    is_package = _path_of(module.name).name == "__init__.py"
    base = package if is_package else package[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


# ---------------------------------------------------------------- what a registration hook returns

def _table_names(module: Module) -> tuple[dict[str, str], dict[str, str]]:
    """``{table variable: kind}`` of the module's ComponentTables and ``{alias: table}`` of ``X = TABLE.register``."""
    tables, aliases = {}, {}
    for name, node in module.bindings.items():
        value = getattr(node, "value", None)
        if isinstance(node, ast.Assign) and isinstance(value, ast.Call) and \
                ast.unparse(value.func) in ("rltk.ComponentTable", "ComponentTable") and \
                len(value.args) == 1 and isinstance(value.args[0], ast.Constant) and not value.keywords:
            tables[name] = value.args[0].value
    for name, node in module.bindings.items():
        value = getattr(node, "value", None)
        if isinstance(node, ast.Assign) and isinstance(value, ast.Attribute) and value.attr == "register" and \
                isinstance(value.value, ast.Name) and value.value.id in tables:
            aliases[name] = value.value.id
    return tables, aliases


def _registering(decorator: ast.expr, tables: dict, aliases: dict) -> tuple[str, list[str]] | None:
    """``(table, names)`` when ``decorator`` is ``@TABLE.register("a", ...)`` (or an alias of it)."""
    if not isinstance(decorator, ast.Call) or decorator.keywords:
        return None
    func = decorator.func
    if isinstance(func, ast.Attribute) and func.attr == "register" and isinstance(func.value, ast.Name) \
            and func.value.id in tables:
        table = func.value.id
    elif isinstance(func, ast.Name) and func.id in aliases:
        table = aliases[func.id]
    else:
        return None
    if not all(isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value for a in decorator.args):
        return None
    return table, [a.value for a in decorator.args]


def _table_entries(module: Module, table: str) -> dict[str, str] | None:
    tables, aliases = _table_names(module)
    uses = sum(isinstance(n, ast.Name) and n.id == table for n in ast.walk(module.tree))
    expected = 1 + sum(isinstance(getattr(module.bindings.get(a), "value", None), ast.Attribute) for a in aliases
                       if aliases[a] == table)  # its definition, each alias
    entries: dict[str, str] = {}
    for node in module.tree.body:
        for decorator in getattr(node, "decorator_list", []):
            found = _registering(decorator, tables, aliases)
            if found and found[0] == table:
                expected += isinstance(decorator.func, ast.Attribute)
                for name in found[1]:
                    if name in entries:
                        return None
                    entries[name] = f"{module.name}:{node.name}"
    for alias in (a for a in aliases if aliases[a] == table):  # an alias is used only as a decorator
        alias_uses = sum(isinstance(n, ast.Name) and n.id == alias for n in ast.walk(module.tree))
        decorating = sum(isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == alias
                         for node in module.tree.body for d in getattr(node, "decorator_list", []))
        if alias_uses != 1 + decorating:
            return None
    # the table is used only where it is defined, aliased, decorates and is returned (once): nothing else fills it
    return entries if uses == expected + 1 else None


def _ref(module: Module, value: ast.expr) -> str | None:
    if not isinstance(value, ast.Name) or module.bindings.get(value.id) is None:
        return None
    node = module.bindings[value.id]
    if isinstance(node, ast.ImportFrom):
        alias = next(a for a in node.names if (a.asname or a.name) == value.id)
        return f"{_absolute(module, node)}:{alias.name}"
    if isinstance(node, ast.Import):
        return None
    return f"{module.name}:{value.id}"


def read_registrations(module_name: str, hooks: dict[str, str]) -> dict[str, dict[str, str]] | None:
    """``{kind: {name: "module:attribute"}}`` that the registration module ``module_name`` registers, read from
    its source (``hooks``: hook name -> kind); None when the source alone cannot say (then import it)."""
    module = parse_module(module_name)
    if module is None:
        return None
    found: dict[str, dict[str, str]] = {}
    for name, node in module.bindings.items():
        if not name.startswith("rltk_"):
            continue
        if name not in hooks or not isinstance(node, ast.FunctionDef) or node.args.args or node.args.kwonlyargs \
                or any(ast.unparse(d) not in ("rltk.hookimpl", "hookimpl") for d in node.decorator_list):
            return None  # a lifecycle hook, or a hook that needs running: import the module
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
            return None
        value = body[0].value
        if isinstance(value, ast.Name) and value.id in _table_names(module)[0]:
            entries = _table_entries(module, value.id)
        elif isinstance(value, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                                 for k in value.keys):
            entries = {k.value: _ref(module, v) for k, v in zip(value.keys, value.values)}
            if len(entries) != len(value.keys) or None in entries.values():
                return None
        else:
            return None
        if entries is None:
            return None
        found[hooks[name]] = entries
    return found


# ---------------------------------------------------------------- a component's description

class _Opaque:
    """Stands for a class or function the reader does not import (``torch.Tensor``): a config value is never
    checked against one (:func:`rltk.config.components.expected_types` reads nothing from it)."""


class _OpaqueType(type):
    def __getattr__(cls, attr: str):  # torch.nn.Module: what an opaque module's attribute holds is opaque too
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _opaque(attr)


def _opaque(name: str) -> type:
    return _OpaqueType(name, (_Opaque,), {})


class _OpaqueModule:
    def __init__(self, name: str):
        self.__name__ = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _opaque(attr)


def _is_stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names


def _resolve_name(module: Module, name: str, depth: int) -> Any:
    """What ``name`` is bound to at the top of ``module`` once it has run, as far as annotations need."""
    if depth > _MAX_DEPTH:
        raise NotExact(name)
    if name not in module.bindings:
        if hasattr(builtins, name):
            return getattr(builtins, name)
        raise NameError(name)  # what get_type_hints would raise: the names only a type checker sees
    node = module.bindings[name]
    if node is None:
        raise NotExact(name)
    if isinstance(node, ast.Import):
        alias = next(a for a in node.names if (a.asname or a.name).split(".")[0] == name)
        target = alias.name if alias.asname else alias.name.split(".")[0]
        return importlib.import_module(target) if _is_stdlib(target) else _OpaqueModule(target)
    if isinstance(node, ast.ImportFrom):
        alias = next(a for a in node.names if (a.asname or a.name) == name)
        source = _absolute(module, node)
        if _is_stdlib(source):
            return getattr(importlib.import_module(source), alias.name)
        inner = parse_module(source)
        if inner is None:
            return _opaque(alias.name)  # a third-party name: a class for what an annotation can tell
        return _resolve_name(inner, alias.name, depth + 1)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return _opaque(name)
    return _evaluate(module, node.value, depth + 1)


def _evaluate(module: Module, expr: ast.expr, depth: int = 0) -> Any:
    """An annotation (or a type alias's value) as Python would evaluate it, for the forms annotations take."""
    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.Name):
        return _resolve_name(module, expr.id, depth)
    if isinstance(expr, ast.Attribute):
        return getattr(_evaluate(module, expr.value, depth), expr.attr)
    if isinstance(expr, ast.Subscript):
        return _evaluate(module, expr.value, depth)[_evaluate(module, expr.slice, depth)]
    if isinstance(expr, ast.Tuple):
        return tuple(_evaluate(module, e, depth) for e in expr.elts)
    if isinstance(expr, ast.List):
        return [_evaluate(module, e, depth) for e in expr.elts]
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
        return _evaluate(module, expr.left, depth) | _evaluate(module, expr.right, depth)
    raise NotExact(ast.unparse(expr))


_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Pow: lambda a, b: a ** b,
               ast.Mod: lambda a, b: a % b}


def _literal(module: Module, expr: ast.expr, depth: int = 0) -> Any:
    """A default's value: a literal, arithmetic on numbers, a name bound at the top of the module to one, or
    an attribute of a standard-library module (``time.monotonic``)."""
    if depth > _MAX_DEPTH:
        raise NotExact(ast.unparse(expr))
    try:
        return ast.literal_eval(expr)
    except (ValueError, TypeError, SyntaxError):
        pass
    if isinstance(expr, ast.BinOp) and type(expr.op) in _ARITHMETIC:
        left, right = _literal(module, expr.left, depth + 1), _literal(module, expr.right, depth + 1)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
            return _ARITHMETIC[type(expr.op)](left, right)
    if isinstance(expr, ast.Attribute):
        root = expr
        while isinstance(root, ast.Attribute):
            root = root.value
        node = module.bindings.get(root.id) if isinstance(root, ast.Name) else None
        if isinstance(node, ast.Import) and all(_is_stdlib(a.name) for a in node.names):
            return _evaluate(module, expr, depth)
    node = module.bindings.get(expr.id) if isinstance(expr, ast.Name) else None
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        return _literal(module, node.value, depth + 1)
    raise NotExact(ast.unparse(expr))


def _signature(module: Module, fn: ast.FunctionDef, drop_first: bool) -> tuple[inspect.Signature, dict | None]:
    """The signature (annotations as the module holds them) and the type hints, None where
    ``typing.get_type_hints`` would raise."""
    P = inspect.Parameter
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    spec = [(arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD, d)
            for i, (arg, d) in enumerate(zip(positional, defaults))]
    if a.vararg:
        spec.append((a.vararg, P.VAR_POSITIONAL, None))
    spec += [(arg, P.KEYWORD_ONLY, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        spec.append((a.kwarg, P.VAR_KEYWORD, None))
    hints: dict | None = {}
    annotated = [(arg.arg, arg.annotation) for arg, _, _ in spec if arg.annotation is not None]
    annotated += [("return", fn.returns)] if fn.returns is not None else []
    values = {}
    for name, annotation in annotated:
        try:
            values[name] = _evaluate(module, annotation)
        except NameError:
            if not module.future_annotations:
                raise NotExact(name)  # the module would not even import
            hints = None
    if hints is not None:
        hints = {n: (type(None) if v is None else v) for n, v in values.items()}
    params = []
    for arg, kind, default in (spec[1:] if drop_first else spec):
        shown = P.empty if arg.annotation is None else (
            ast.unparse(arg.annotation) if module.future_annotations else values[arg.arg])
        params.append(P(arg.arg, kind, default=P.empty if default is None else _literal(module, default),
                        annotation=shown))
    return inspect.Signature(params), hints


#: Base classes that add no ``__init__`` and no class attributes a component's description reads.
_PLAIN_BASES = ("object", "abc.ABC", "typing.Generic")


class Described:
    """A builtin component as its source describes it, for checking a config against it without importing it.

    :func:`inspect.signature` and :func:`typing.get_type_hints` read it as they read the component (``self``
    left out of a class's); ``doc`` is its docstring; an attribute the source sets to a literal is that
    literal; anything else it is asked for (a method, ``check_args``) comes from the imported component.
    """

    def __init__(self, ref: str, resolve: Callable[[], Any], *, is_function: bool, signature: inspect.Signature,
                 hints: dict | None, doc: str | None, attributes: dict[str, Any], unknown: set[str], closed: bool):
        self.ref = ref
        self.__module__, _, self.__qualname__ = ref.partition(":")  # where it is defined
        self.__name__ = self.__qualname__
        self.is_function = is_function
        self.__signature__ = signature
        self.__doc__ = doc
        self._hints = hints
        self._resolve = resolve
        self._attributes = attributes
        self._unknown = unknown  # attributes the source sets to something only running it gives
        self._closed = closed  # every class on the way up is known: an attribute found nowhere is missing

    @property
    def __annotations__(self):  # noqa: D401  (read by typing.get_type_hints)
        if self._hints is None:
            raise NameError(f"{self.ref}: an annotation names what only a type checker imports")
        return self._hints

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._attributes:
            return self._attributes[name]
        if name not in self._unknown and self._closed:
            raise AttributeError(name)
        return getattr(self._resolve(), name)

    def __call__(self, *args, **kwargs):
        return self._resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.ref}, read from its source>"


def _definition(module: Module, name: str, depth: int = 0) -> tuple[Module, ast.stmt]:
    node = module.bindings.get(name)
    if isinstance(node, ast.ImportFrom) and depth < _MAX_DEPTH:
        alias = next(a for a in node.names if (a.asname or a.name) == name)
        inner = parse_module(_absolute(module, node))
        if inner is not None:
            return _definition(inner, alias.name, depth + 1)
    if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        raise NotExact(f"{module.name}:{name}")
    return module, node


#: Decorators that return the function itself, marked by an attribute: its signature and docstring stay.
MARKING_DECORATORS = frozenset({"rltk.rewards.marks:bounded", "rltk.rewards.marks:batched"})


def _origin(module: Module, name: str) -> str | None:
    """``"module:name"`` where the name imported as ``name`` into ``module`` is defined (re-exports followed)."""
    for _ in range(_MAX_DEPTH):
        node = module.bindings.get(name)
        if not isinstance(node, ast.ImportFrom):
            return f"{module.name}:{name}"
        alias = next(a for a in node.names if (a.asname or a.name) == name)
        inner = parse_module(_absolute(module, node))
        if inner is None:
            return None
        module, name = inner, alias.name
    return None


def _check_decorators(module: Module, node: ast.stmt) -> bool:
    """Raise NotExact unless each decorator registers (or only marks, :data:`MARKING_DECORATORS`); True when
    one marks it (its attributes are then read from the imported function)."""
    tables, aliases = _table_names(module)
    marked = False
    for decorator in node.decorator_list:
        if _registering(decorator, tables, aliases) is not None:
            continue
        func = decorator.func if isinstance(decorator, ast.Call) else decorator
        if not isinstance(func, ast.Name) or _origin(module, func.id) not in MARKING_DECORATORS:
            raise NotExact(f"{module.name}:{node.name} is decorated")
        marked = True
    return marked


def _bases(module: Module, node: ast.ClassDef) -> list[tuple[Module, ast.ClassDef]]:
    """The rltk classes ``node`` derives from, in order (``object``, ``abc.ABC`` and ``Generic[...]`` left out)."""
    if node.keywords:
        raise NotExact(f"{module.name}:{node.name} has a metaclass")
    found = []
    for base in node.bases:
        target = base.value if isinstance(base, ast.Subscript) else base
        value = _evaluate(module, target)
        if value is object or f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}" in \
                ("abc.ABC", "typing.Generic"):
            continue
        if not isinstance(target, ast.Name):
            raise NotExact(ast.unparse(base))
        inner, definition = _definition(module, target.id)
        if not isinstance(definition, ast.ClassDef):
            raise NotExact(ast.unparse(base))
        _check_decorators(inner, definition)
        found.append((inner, definition))
    return found


def _class_chain(module: Module, node: ast.ClassDef, depth: int = 0) -> tuple[list[tuple[Module, ast.ClassDef]], bool]:
    """The class's method resolution order over its rltk classes (C3, as Python computes it; the plain bases
    left out, since they add nothing read here), and True (every class on the way up is known)."""
    if depth > _MAX_DEPTH:
        raise NotExact(f"{module.name}:{node.name}")
    if depth == 0:
        _check_decorators(module, node)
    key = lambda pair: (pair[0].name, pair[1].name)  # noqa: E731
    bases = _bases(module, node)
    sequences = [[key(c) for c in _class_chain(*b, depth + 1)[0]] for b in bases] + [[key(b) for b in bases]]
    by_key = {key((module, node)): (module, node)}
    for b in bases:
        by_key.update({key(c): c for c in _class_chain(*b, depth + 1)[0]})
    order = [key((module, node))]
    while any(sequences):
        sequences = [seq for seq in sequences if seq]
        head = next((seq[0] for seq in sequences if not any(seq[0] in other[1:] for other in sequences)), None)
        if head is None:
            raise NotExact(f"{module.name}:{node.name}: no consistent method resolution order")
        order.append(head)
        sequences = [seq[1:] if seq[0] == head else seq for seq in sequences]
    return [by_key[k] for k in order], True


def _class_attributes(chain) -> tuple[dict[str, Any], set[str]]:
    values: dict[str, Any] = {}
    unknown: set[str] = set()
    for module, node in reversed(chain):  # the class's own win over its bases'
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if stmt.name == "__init_subclass__":
                    raise NotExact(f"{module.name}:{node.name}.__init_subclass__")
                values.pop(stmt.name, None)
                unknown.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    if not isinstance(target, ast.Name):
                        raise NotExact(f"{module.name}:{node.name}")
                    if getattr(stmt, "value", None) is None:
                        continue
                    try:
                        values[target.id] = _literal(module, stmt.value)
                        unknown.discard(target.id)
                    except (NotExact, ValueError, TypeError, SyntaxError):
                        values.pop(target.id, None)
                        unknown.add(target.id)
            elif not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)) \
                    and not isinstance(stmt, ast.Pass):
                raise NotExact(f"{module.name}:{node.name}")
    return values, unknown


def describe(ref: str, resolve: Callable[[], Any]) -> Described | None:
    """The component ``"module:attribute"`` read from its source, or None when the source alone cannot say."""
    module_name, _, name = ref.partition(":")
    module = parse_module(module_name)
    if module is None or "." in name:
        return None
    try:
        module, node = _definition(module, name)
        ref = f"{module.name}:{node.name}"
        if isinstance(node, ast.FunctionDef):
            marked = _check_decorators(module, node)
            signature, hints = _signature(module, node, drop_first=False)
            attrs = module.attribute_assigns.get(node.name, set())
            return Described(ref, resolve, is_function=True, signature=signature, hints=hints,
                             doc=ast.get_docstring(node, clean=False), attributes={}, unknown=set(attrs),
                             closed=not marked)
        chain, closed = _class_chain(module, node)
        if any(node.name in m.attribute_assigns for m, node in chain):
            raise NotExact(ref)
        values, unknown = _class_attributes(chain)
        init = next(((m, s) for m, c in chain for s in c.body
                     if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if init is None:
            P = inspect.Parameter
            signature, hints = inspect.Signature([P("args", P.VAR_POSITIONAL), P("kwargs", P.VAR_KEYWORD)]), {}
        else:
            _check_decorators(*init)
            signature, hints = _signature(init[0], init[1], drop_first=True)
        doc = ast.get_docstring(node, clean=False)
        if doc is None:  # inspect.getdoc would look up the bases'
            raise NotExact(ref)
        return Described(ref, resolve, is_function=False, signature=signature, hints=hints, doc=doc,
                         attributes=values, unknown=unknown, closed=closed)
    except (NotExact, NameError, AttributeError, TypeError, KeyError, StopIteration, SyntaxError, ValueError):
        return None
