"""Say once per process why a faster path does not apply.

rltk takes faster paths where a model allows them (prompt sharing in the policy forward, the
``hf`` engine's own sampling loop, the fused log-prob op). Where one cannot run, the slower path
gives the same numbers, so nothing fails: without a word the user would only see a slower run.
:func:`notice_once` logs the reason the first time it is met, and never again for that reason.

The other notice: a module that moved. :func:`alias_moved_modules` keeps its old name importable for
one release, with a ``DeprecationWarning`` naming the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
import warnings

_said: set[tuple[str, str]] = set()


def notice_once(logger: logging.Logger, topic: str, reason: str) -> None:
    """Log ``"<topic>: <reason>"`` as a warning, the first time this process meets that pair."""
    if (topic, reason) in _said:
        return
    _said.add((topic, reason))
    logger.warning("%s: %s", topic, reason)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name as the module it moved to, with a deprecation warning naming the new one."""

    def __init__(self, moved: dict[str, str]):
        self.moved = moved

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def _warn(self, old: str) -> str:
        new = self.moved[old]
        warnings.warn(f"{old} moved to {new}: import it from there (the old name goes in the next release)",
                      DeprecationWarning, stacklevel=3)  # the import line: warnings skips importlib's frames
        return new

    def create_module(self, spec):
        return importlib.import_module(self._warn(spec.name))

    def exec_module(self, module):
        """Nothing to run: the module under its new name ran when it was imported."""

    def get_code(self, fullname):
        """``python -m <old name>`` runs the moved module's code as ``__main__``."""
        new = self._warn(fullname)
        return importlib.util.find_spec(new).loader.get_code(new)


def alias_moved_modules(moved: dict[str, str]) -> None:
    """Keep the old names of moved modules importable for one release: ``moved`` maps each old full name
    (``rltk.buffer.queue``) to its new one; importing the old name gives the new module and a
    ``DeprecationWarning`` naming it. Called by the old names' package, so it runs before they are looked up.

    The new names are strings, never imports: a package whose module moved up a layer does not import it."""
    finder = _MovedModules(dict(moved))
    for entry in sys.meta_path:
        if isinstance(entry, _MovedModules):
            entry.moved.update(finder.moved)
            return
    sys.meta_path.append(finder)


def moved_modules() -> dict[str, str]:
    """Every old module name aliased so far in this process, with its new one."""
    return {old: new for entry in sys.meta_path if isinstance(entry, _MovedModules) for old, new in entry.moved.items()}


def warn_old_call(old: str, new: str) -> None:
    """The ``DeprecationWarning`` of a call written in a form that changed: ``old`` and ``new`` are the two forms,
    as a caller writes them. The old form keeps working for one release; the warning points at its caller."""
    warnings.warn(f"{old} is deprecated: call {new} (the old form goes in the next release)", DeprecationWarning,
                  stacklevel=3)
