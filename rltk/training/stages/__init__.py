"""A run as stages, and what a stage does around its steps (the top floor of ``rltk.training``).

* :mod:`~rltk.training.stages.run`: open a run, run its stages (each runner returns its strategy), finish it.
* :mod:`~rltk.training.stages.loop_state`: what an RL stage carries from step to step; ``RLParts``; ``sampled_batch``.
* :mod:`~rltk.training.stages.stage_checkpoint`: ``StageCheckpoint``, a stage's save and restore side by side.
* :mod:`~rltk.training.stages.step_end`: the end of every step (evaluate, log, guard, checkpoint).
* :mod:`~rltk.training.stages.sft_stage`: the supervised warm-up stage.
"""
