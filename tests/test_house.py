"""The house stays built: no module circle, no function over 100 lines, no folder over 15 modules.

Each limit is checked over the whole of ``rltk/`` from the source (nothing is imported), so a feature that
brings an offender back fails here with its name and the limit, not in a later review. The imports are
those of :mod:`tests.test_layers` (lazy imports count; ``TYPE_CHECKING`` blocks do not).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layers import PACKAGE, ROOT, edges

MAX_FUNCTION_LINES = 100
MAX_FOLDER_MODULES = 15  # a package's __init__ counts: it is a module like the others

#: frozenset of the modules of a circle: why it is still allowed and who removes it. The test fails when an
#: entry no longer occurs, so the list only shrinks.
KNOWN_CIRCLES: dict[frozenset[str], str] = {}

#: folder (relative to the repository) -> why it may still hold more than the limit. Only shrinks: the test fails
#: when an entry fits again.
KNOWN_CROWDED: dict[str, str] = {}


def module_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph`` (module -> the modules it imports), each as its sorted modules.

    An import of a module's own package (``rltk.config.loader`` of ``rltk.config``) is left out: the package's
    ``__init__`` runs before any of its modules whether or not they name it, so that edge closes no circle a
    reader could break. Tarjan's strongly connected components, iterative (no recursion limit on a deep tree).
    """
    graph = {a: {b for b in out if not a.startswith(b + ".")} for a, out in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    circles.append(sorted(members))
    return sorted(circles)


def long_functions(package: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function or method under ``package`` longer than ``limit`` lines (decorators left out, its
    docstring in), as ``path:line name (N lines)``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def crowded_folders(package: Path, limit: int = MAX_FOLDER_MODULES) -> list[str]:
    """Every folder under ``package`` (itself included) holding more than ``limit`` modules, as
    ``folder/ (N modules)``."""
    folders = [package, *sorted(p for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__")]
    counts = {folder: len(list(folder.glob("*.py"))) for folder in folders}
    return [f"{folder.relative_to(package.parent)}/ ({count} modules)" for folder, count in counts.items()
            if count > limit]


def test_no_module_imports_itself_through_a_circle():
    circles = {frozenset(circle): circle for circle in module_circles(edges())}
    unexpected = [circle for key, circle in circles.items() if key not in KNOWN_CIRCLES]
    assert not unexpected, "modules that import each other (through any chain; move what both need into one " \
        "of them or below both):\n" + "\n".join("  " + " <-> ".join(circle) for circle in unexpected)
    gone = [sorted(key) for key in KNOWN_CIRCLES if key not in circles]
    assert not gone, f"no longer a circle, remove from KNOWN_CIRCLES: {gone}"


def test_no_function_is_over_100_lines():
    found = long_functions(PACKAGE)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split each into steps with names):\n" + \
        "\n".join("  " + line for line in found)


def test_no_folder_holds_over_15_modules():
    crowded = crowded_folders(PACKAGE)
    found = [line for line in crowded if line.split(" ")[0] not in KNOWN_CROWDED]
    gone = sorted(set(KNOWN_CROWDED) - {line.split(" ")[0] for line in crowded})
    assert not gone, f"no longer over {MAX_FOLDER_MODULES} modules, remove from KNOWN_CROWDED: {gone}"
    assert not found, f"folders over {MAX_FOLDER_MODULES} modules (split each by concern into subpackages, " \
        "with an __init__ that maps them, as rltk/rewards/):\n" + "\n".join("  " + line for line in found)


def test_the_checks_name_what_they_find(tmp_path):
    package = tmp_path / "rltk"
    (package / "crowded").mkdir(parents=True)
    for i in range(MAX_FOLDER_MODULES + 1):
        (package / "crowded" / f"m{i}.py").write_text("")
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))  # with its def line: 100 lines
    method = body.replace("    x", "        x") + "        return 1\n"  # one line more
    (package / "long.py").write_text(f"def fits():\n{body}\n\nclass C:\n    @staticmethod\n"
                                     f"    def too_long():\n{method}")
    assert long_functions(package) == ["rltk/long.py:105 too_long (101 lines)"]
    assert crowded_folders(package) == [f"rltk/crowded/ ({MAX_FOLDER_MODULES + 1} modules)"]
    # a -> b -> c -> a is a circle; a package's __init__ importing a module that imports the package is not
    graph = {"rltk": {"rltk.a"}, "rltk.a": {"rltk.b", "rltk.a.x"}, "rltk.a.x": {"rltk.a"}, "rltk.b": {"rltk.c"},
             "rltk.c": {"rltk.a", "rltk"}, "rltk.d": {"rltk.a"}}
    assert module_circles(graph) == [["rltk.a", "rltk.b", "rltk.c"]]
