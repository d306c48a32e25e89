"""Where a step's experiences come from: sampled in the trainer, or by producer processes.

The synchronous path (``trainer.mode=sync``) reads in three files:

* :mod:`~rltk.training.rollouts.rollout_source`: the one interface a loop reads (``take``, ``after_update``,
  ``cursor``, ``commit``, ``close``), sync or async, and the sync source itself.
* :mod:`~rltk.training.rollouts.collect`: a step's rollouts (dynamic sampling, greedy baselines), expert data.
* :mod:`~rltk.training.rollouts.engine_weights`: how a rollout engine follows the trainer's weights.

:mod:`rltk.training.rollouts.asynchronous` is the async wing (``one_step_off``, ``async``): producers, their
experience queue, and producers on Ray, imported only by a stage that runs it.

The wing's modules sat here (and the queue in ``rltk.buffer``) until 2026-12; their old names keep working
for one release, with a ``DeprecationWarning`` naming the new one (``ray_cluster``, which places reward
services for synchronous stages too, went to :mod:`rltk.training.scaffold`).
"""

from rltk.notices import alias_moved_modules

#: old module name -> where it lives now
MOVED = {
    **{f"{__name__}.{name}": f"{__name__}.asynchronous.{name}" for name in ("async_rollout", "producer", "ray_source")},
    f"{__name__}.ray_cluster": "rltk.training.scaffold.ray_cluster",
}

alias_moved_modules(MOVED)
