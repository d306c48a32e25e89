"""Parsing Python source at run time, safe beside other threads: an ``ast.parse`` in rltk goes through here.

CPython (3.11 here; python/cpython#106905) counts the recursion depth of the AST constructor, the step of
``ast.parse`` that turns the parser's tree into Python objects, in one place per interpreter, not per call.
When a garbage collection during that step runs a finalizer, the finalizer's Python code may hand the GIL to
another thread; if that thread parses too, it resets the shared count, and the first parse fails with
``SystemError: AST constructor recursion depth mismatch (before=153, after=84)``, a correct source refused.
A run has such threads (reward workers, servers, a thread formatting a traceback, which in 3.11 parses the
failing line to place its ``^^^``), so rltk parses source at run time (schema comments, reward
expressions, assert tests) with :func:`parse_python`: the collector is off while the tree is built, so no
Python code runs and the GIL stays with this thread until the tree is whole; a lock keeps rltk's own threads
from turning the collector back on under each other. A parse outside rltk can still be hit by one of ours,
never the other way round.
"""

from __future__ import annotations

import ast
import gc
import threading

_LOCK = threading.Lock()


def parse_python(source: str, filename: str = "<unknown>", mode: str = "exec") -> ast.AST:
    """``ast.parse(source, filename, mode)``, never interleaved with another thread's parse (see the module)."""
    with _LOCK:
        collecting = gc.isenabled()
        gc.disable()
        try:
            return ast.parse(source, filename=filename, mode=mode)
        finally:
            if collecting:
                gc.enable()
