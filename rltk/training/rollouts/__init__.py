"""Where a step's experiences come from: sampled in the trainer, or by producer processes.

* :mod:`~rltk.training.rollouts.collect`: a step's rollouts (dynamic sampling, greedy baselines), expert data.
* :mod:`~rltk.training.rollouts.rollout_source`: the one interface a loop reads (``take``, ``after_update``,
  ``cursor``, ``commit``, ``close``), sync or async.
* :mod:`~rltk.training.rollouts.async_rollout`: the trainer's side of asynchronous RL: queue, producers, weights.
* :mod:`~rltk.training.rollouts.producer`: a producer process (``python -m rltk.training.rollouts.producer``).
* :mod:`~rltk.training.rollouts.ray_cluster`: ``launcher=ray``: reaching the cluster, checking and placing actors.
* :mod:`~rltk.training.rollouts.ray_source`: ``launcher=ray``: producers as Ray actors, queue and weights over
  the network (imports Ray; imported only then).
* :mod:`~rltk.training.rollouts.engine_weights`: how a rollout engine follows the trainer's weights.
"""
