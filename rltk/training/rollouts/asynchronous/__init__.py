"""The async wing: a stage whose experiences producers sample with older weights (``trainer.mode=one_step_off``
or ``async``). Nothing here runs in a synchronous stage, which never imports it.

* :mod:`~rltk.training.rollouts.asynchronous.async_rollout`: the trainer's side: its queue, the producer
  processes it starts and restarts, the weights it publishes, the hand-over to every rank.
* :mod:`~rltk.training.rollouts.asynchronous.producer`: a producer process
  (``python -m rltk.training.rollouts.asynchronous.producer``, or ``rltk produce``).
* :mod:`~rltk.training.rollouts.asynchronous.queue`: the persistent experience queue (SQLite) between them,
  with leases, staleness and the cursor a resume checks.
* :mod:`~rltk.training.rollouts.asynchronous.ray_source`: ``launcher=ray``: producers as Ray actors, queue and
  weights over the network (imports Ray; imported only then). The cluster itself is
  :mod:`rltk.training.scaffold.ray_cluster`.
"""
