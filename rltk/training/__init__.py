"""The training loop's pieces, in rooms from the ground floor up (an import only points down a room):

* :mod:`rltk.training.scaffold`: what every run is built from and writes around its loop (setup, rows,
  resume point, outputs, divergence guard, traces, evaluation, export);
* :mod:`rltk.training.step`: one step's mechanics (ranks, micro-batches, forward passes, reference,
  estimator, loss components, rollout correction);
* :mod:`rltk.training.rollouts`: where a step's experiences come from (sampled here, or by producers);
* :mod:`rltk.training.updates`: the updates on one skeleton (policy, critic, preference, SFT, distillation);
* :mod:`rltk.training.stages`: a run as stages, and a stage's loop state, checkpoint and step tail.

Until 2026-11 these modules sat flat in this package; their old names (``rltk.training.rl`` ...) keep
working for one release, with a ``DeprecationWarning`` naming the new one.
"""

from rltk.notices import alias_moved_modules

#: module -> the room it moved to (``rltk.training.<module>`` is now ``rltk.training.<room>.<module>``; the async
#: wing's modules moved on into ``rollouts.asynchronous`` in 2026-12).
MOVED = {
    **dict.fromkeys(("setup", "rows", "resume", "run_outputs", "guard", "traces", "evaluation", "export"), "scaffold"),
    **dict.fromkeys(("ranks", "micro_batches", "forward", "reference", "estimator", "loss_components",
                     "rollout_correction", "batch_metrics"), "step"),
    **dict.fromkeys(("collect", "engine_weights", "rollout_source"), "rollouts"),
    **dict.fromkeys(("producer", "async_rollout"), "rollouts.asynchronous"),
    **dict.fromkeys(("update_loop", "rl", "ppo", "preference", "sft", "distill", "reward_model"), "updates"),
    **dict.fromkeys(("loop_state", "stage_checkpoint", "step_end", "run", "sft_stage"), "stages"),
}

alias_moved_modules({f"{__name__}.{module}": f"{__name__}.{room}.{module}" for module, room in MOVED.items()})
