"""The package's layers hold: an import only ever points down, and no two packages import each other.

Read from the source with ``ast`` (nothing is imported): every ``import`` counts, at the top of a
module or inside a function (a lazy import hides a cycle; it does not remove it), and importing
``a.b.c`` counts as importing ``a`` and ``a.b`` too, since their ``__init__`` runs first. Imports
under ``if TYPE_CHECKING:`` do not run and are left out.

The layers, bottom to top (``../shared/DESIGN.md``, "The next rooms"): errors, batch types, I/O
and distributed helpers -> algorithms, kernels -> models, data, rewards, tools, environments,
loggers -> rollout engines, the OpenAI-compatible endpoint, workflows, buffer -> strategies,
checkpoints -> config (loading and validation of a whole config) -> the training loop (its rooms:
scaffold -> step -> rollouts -> updates -> stages) -> recipes, the commands, dashboard.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rltk"

LAYERS: list[tuple[str, ...]] = [
    ("rltk", "rltk.registry", "rltk.hookspecs", "rltk.errors", "rltk.batch", "rltk.batch_types",
     "rltk.serialization", "rltk.io", "rltk.argv", "rltk.distributed", "rltk.notices", "rltk.parsing",
     "rltk.components", "rltk.registration"),
    ("rltk.algorithms", "rltk.kernels"),
    ("rltk.models", "rltk.data", "rltk.rewards", "rltk.tools", "rltk.environments", "rltk.loggers"),
    # the OpenAI-compatible endpoint over a rollout engine is a peer of the workflows (agentic runs one);
    # the `rltk serve` command, which loads checkpoints, is rltk.commands.serve at the top
    ("rltk.rollout", "rltk.serve", "rltk.tinker_service", "rltk.workflows", "rltk.buffer"),
    ("rltk.strategies", "rltk.checkpoint"),
    ("rltk.config",),
    # the training loop's rooms, each on the ones below (rltk.training's __init__ is a map and imports none)
    ("rltk.training", "rltk.training.scaffold"),
    ("rltk.training.step",),
    ("rltk.training.rollouts",),
    ("rltk.training.updates",),
    ("rltk.training.stages",),
    ("rltk.recipe_tools", "rltk.recipes", "rltk.commands", "rltk._recipes", "rltk.dashboard"),
]

#: (importing module, imported module): why it is still allowed. Each entry names who removes it;
#: the test fails when an entry no longer occurs, so the list only shrinks.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return skipped


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every rltk module ``name`` imports, anywhere in the file, with the packages above each."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
    found = set()
    for target in targets:
        if not (target == "rltk" or target.startswith("rltk.")):
            continue
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # a.b.c runs a/__init__ and a/b/__init__ first
            prefix = ".".join(parts[:i])
            if prefix in known and prefix != name:
                found.add(prefix)
    return found


def layer_of(name: str) -> int:
    best, layer = "", None
    for i, members in enumerate(LAYERS):
        for member in members:
            # the package itself ("rltk") is its __init__ alone: a new top-level module must be placed
            inside = name.startswith(member + ".") and member != "rltk"
            if (name == member or inside) and len(member) > len(best):
                best, layer = member, i
    assert layer is not None, f"{name} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return layer


def room_of(name: str) -> str:
    """The package a module lives in (``rltk.models``; in the training loop its room, ``rltk.training.step``), or
    the module itself at the top (``rltk.recipes``)."""
    parts = name.split(".")
    return ".".join(parts[:3] if parts[:2] == ["rltk", "training"] and len(parts) > 2 else parts[:2])


@functools.cache
def edges() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_no_module_imports_a_higher_layer():
    upward = {(a, b) for a, targets in edges().items() for b in targets if layer_of(b) > layer_of(a)}
    unexpected = sorted(upward - set(KNOWN_UPWARD))
    assert not unexpected, "imports that point up a layer:\n" + "\n".join(
        f"  {a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})" for a, b in unexpected)
    gone = sorted(set(KNOWN_UPWARD) - upward)
    assert not gone, f"no longer imported, remove from KNOWN_UPWARD: {gone}"


def test_no_two_packages_import_each_other():
    rooms: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges().items():  # a known upward import is reported above, with its reason
        rooms[room_of(a)].update(room_of(b) for b in targets if room_of(b) != room_of(a) and (a, b) not in KNOWN_UPWARD)
    # a cycle of any length shows as a pair of rooms that reach each other
    reach = {room: set(out) for room, out in rooms.items()}
    changed = True
    while changed:
        changed = False
        for room, out in reach.items():
            more = set().union(*(reach.get(r, set()) for r in out)) - out
            if more:
                out |= more
                changed = True
    cycles = {frozenset({a, b}) for a, out in reach.items() for b in out if a < b and a in reach.get(b, set())
              and "rltk" not in (a, b)}
    assert not cycles, f"packages that import each other (through any chain): {sorted(map(sorted, cycles))}"


def test_the_walk_sees_lazy_imports_and_parent_packages(tmp_path):
    source = tmp_path / "rltk" / "models" / "m.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from rltk.training.stages.run import open_run\n")
    known = {"rltk", "rltk.models", "rltk.models.m", "rltk.training", "rltk.training.stages.run"}
    assert imports_of("rltk.models.m", source, known) == {"rltk", "rltk.training", "rltk.training.stages.run"}
    assert layer_of("rltk.training.stages.run") > layer_of("rltk.models.m")
