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

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: module -> the room it moved to (``rltk.training.<module>`` is now ``rltk.training.<room>.<module>``).
MOVED = {
    **dict.fromkeys(("setup", "rows", "resume", "run_outputs", "guard", "traces", "evaluation", "export"), "scaffold"),
    **dict.fromkeys(("ranks", "micro_batches", "forward", "reference", "estimator", "loss_components",
                     "rollout_correction", "batch_metrics"), "step"),
    **dict.fromkeys(("collect", "engine_weights", "producer", "async_rollout", "rollout_source"), "rollouts"),
    **dict.fromkeys(("update_loop", "rl", "ppo", "preference", "sft", "distill", "reward_model"), "updates"),
    **dict.fromkeys(("loop_state", "stage_checkpoint", "step_end", "run", "sft_stage"), "stages"),
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old ``rltk.training.<module>`` as the module in its room, with a deprecation warning."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        name = spec.name.rpartition(".")[2]
        new = f"{__name__}.{MOVED[name]}.{name}"
        warnings.warn(f"{spec.name} moved to {new}: import it from there (the old name goes in the next release)",
                      DeprecationWarning, stacklevel=2)  # the import line: warnings skips importlib's frames
        return importlib.import_module(new)

    def exec_module(self, module):
        """Nothing to run: the module in its room ran when it was imported."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
