"""Moved to :mod:`rltk.commands.serve`; ``rltk.serve_command`` keeps working for one release, with a deprecation warning."""

import importlib
import sys
import warnings

warnings.warn("rltk.serve_command moved to rltk.commands.serve: import it from there (the old name goes in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("rltk.commands.serve")
