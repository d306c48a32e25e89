"""The experience buffer a step's rollouts go into, and the sample strategies that pick what the trainer reads.

* :mod:`rltk.buffer.buffer`: the in-memory buffer, its items and their policy versions.
* :mod:`rltk.buffer.strategies`: the sample strategies (kind ``sample_strategy``).

The persistent experience queue of asynchronous training sat here as ``rltk.buffer.queue`` until 2026-12; it is
:mod:`rltk.training.rollouts.asynchronous.queue` now, and the old name keeps working for one release, with a
``DeprecationWarning``.
"""

from rltk.notices import alias_moved_modules

# a name, not an import: the queue moved up to the training loop's async wing, which this layer never imports
alias_moved_modules({"rltk.buffer.queue": "rltk.training.rollouts.asynchronous.queue"})
