"""How the rollout engine follows the weights training changes: shared, copied, or loaded.

Weights across stages. ``run.policy`` is the policy between stages: a plain
module. A stage builds its strategy on it, and :func:`connect_rollout_engine`
points the rollout engine at the weights the stage trains (the module itself,
or a whole copy of the engine's own when the strategy shards parameters, as
ZeRO-3 does). When the stage ends, the trained module comes back from the
strategy and :func:`engine_follows` points the engine at it.
"""

from __future__ import annotations

from torch import nn


def connect_rollout_engine(engine, strategy) -> None:
    """Make ``engine`` sample from the weights ``strategy`` trains. Collective if it shards parameters.

    An engine that can sample from a module (``hf``) shares the trainer's
    module, so an optimizer step needs no copy. A strategy that shards
    parameters (ZeRO-3) makes every forward of that module a collective: ranks
    would have to generate in lockstep and an evaluation on one rank would
    hang, so the engine gets a whole copy of its own instead, refreshed by
    ``engine.update_weights(strategy.unwrap())`` after each optimizer step.
    Engines with weights of their own (``vllm``) load the full weights.
    """
    if hasattr(engine, "use_model"):
        engine.use_model(strategy.full_model_copy() if strategy.shards_parameters else strategy.unwrap())
    else:
        engine.update_weights(strategy.full_state_dict())


def engine_follows(engine, policy: nn.Module) -> None:
    """Point the rollout ``engine`` at ``policy``, a plain module (between stages)."""
    if hasattr(engine, "use_model"):
        engine.use_model(policy)
    else:
        engine.update_weights(policy)
