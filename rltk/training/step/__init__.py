"""The mechanics of one training step: passes over a batch, and the components that read it.

* :mod:`~rltk.training.step.ranks`: numbers every rank agrees on (global means and counts).
* :mod:`~rltk.training.step.micro_batches`: micro-batches by a token budget, trimmed or packed.
* :mod:`~rltk.training.step.forward`: ``ForwardSettings``, the one way every log-prob pass runs; the old-log-prob pass.
* :mod:`~rltk.training.step.reference`: the frozen reference policy.
* :mod:`~rltk.training.step.estimator`: the advantage estimator as the loop calls it (its signature read once).
* :mod:`~rltk.training.step.loss_components`: the policy update's components, each chosen by name.
* :mod:`~rltk.training.step.rollout_correction`: the rollout/trainer mismatch corrections (TIS, MIS, rejection).
* :mod:`~rltk.training.step.batch_metrics`: what a step logs about its batch.
"""
