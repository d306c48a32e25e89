"""The updates: a batch in, optimizer steps out, each on the one skeleton of epochs and mini-batches.

* :mod:`~rltk.training.updates.update_loop`: ``optimizer_epochs`` / ``optimizer_step``, the skeleton.
* :mod:`~rltk.training.updates.rl`: ``policy_update``, the policy-gradient update of every RL recipe.
* :mod:`~rltk.training.updates.ppo`: the critic: value predictions, its update, policy and critic checkpointed together.
* :mod:`~rltk.training.updates.preference`: DPO's pairs, pair batches and ``preference_step``.
* :mod:`~rltk.training.updates.sft`: supervised fine-tuning's batch and step.
* :mod:`~rltk.training.updates.distill`: the teacher of on-policy distillation.
* :mod:`~rltk.training.updates.reward_model`: reward-model training pieces (Bradley-Terry pairs).
"""
