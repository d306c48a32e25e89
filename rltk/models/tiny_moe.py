"""Moved into :mod:`rltk.models.tiny`; ``rltk.models.tiny_moe`` keeps working for one release, with a deprecation warning.

The MoE builder imported the dense model's defaults and tokenizer from ``tiny``, and ``tiny`` imported it back to
build a ``model.tiny`` section with ``moe.num_experts > 0``: one module ends that circle.
"""

import importlib
import sys
import warnings

warnings.warn("rltk.models.tiny_moe moved into rltk.models.tiny: import it from there (the old name goes in the next "
              "release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("rltk.models.tiny")
