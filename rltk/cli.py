"""Moved to :mod:`rltk.commands.cli`; ``rltk.cli`` keeps working for one release, with a deprecation warning."""

import importlib
import sys
import warnings

if __name__ == "__main__":  # python -m rltk.cli
    from rltk.commands.cli import console_main

    sys.exit(console_main())
warnings.warn("rltk.cli moved to rltk.commands.cli: import it from there (the old name goes in the next release)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("rltk.commands.cli")
