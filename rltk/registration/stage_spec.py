"""A training loop as a registered component (kind ``stage``): what its steps provide, and the loop itself.

A stage is what one entry of a config's ``stages`` runs (``type: grpo``). Its spec is light on purpose:
``rltk validate`` and ``rltk list stage`` read what a stage provides from the registry without importing
torch, so the loop is named as ``"module:function"`` and imported the first time the stage runs (a plugin
may also pass the function itself)::

    @rltk.hookimpl
    def rltk_stages():
        return {"rft": rltk.StageSpec("rltk_plugin_example.rft:run_rft_stage",
                                      "Rejection-sampling fine-tuning: SFT on the samples the reward accepts.",
                                      provides={"batch_fields": []})}

The loop is called with the running :class:`rltk.training.stages.run.Stage` and returns the training
strategy that holds the trained policy (or None when it trains none), see
:func:`rltk.training.stages.run.run_stages`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

#: The batch fields every step of :func:`rltk.training.stages.loop_state.rl_steps` holds once its old
#: log-probs are taken: what collate builds from any experiences (``baseline_scores`` and
#: ``reward_components`` only when the estimator names them) and ``old_logprobs``.
RL_STEP_FIELDS = ("input_ids", "attention_mask", "response_mask", "rollout_logprobs", "has_rollout_logprobs",
                  "token_rewards", "scores", "group_ids", "response_lengths", "sequence_rewards", "policy_lengths",
                  "old_logprobs")

#: The ``provides`` keys a stage may declare (see :class:`StageSpec`).
PROVIDES_KEYS = ("batch_fields", "buffer_sources", "expert_data", "trainer_modes", "on_policy_update")


def rl_provides(*fields: str, expert_data: bool = False, on_policy_update: bool = True) -> dict[str, Any]:
    """What a stage whose loop is :func:`~rltk.training.stages.loop_state.rl_steps` provides its components.

    :data:`RL_STEP_FIELDS` plus ``fields``, the batch fields of the passes the loop adds (a reference, a
    critic, a teacher); the ``policy`` buffer source; every ``trainer.mode`` (the rollout source samples in
    the trainer or in producers); ``expert_data``: it lets ``buffer.expert.path``'s experiences into the buffer;
    ``on_policy_update``: its update takes ``old_logprobs`` from its own forward when nothing before it needs
    them (the step plan decides when, :class:`rltk.config.recipe_capabilities.StepPlan`); false for a loop that
    always runs the old-log-prob pass (ppo, distill).
    """
    return {"batch_fields": [*RL_STEP_FIELDS, *fields], "buffer_sources": ["policy"], "expert_data": expert_data,
            "trainer_modes": ["sync", "one_step_off", "async"], "on_policy_update": on_policy_update}


@dataclass(frozen=True)
class StageSpec:
    """A registered training loop: the loop (imported when the stage first runs) and what its steps provide.

    Attributes:
        loop: ``"package.module:function"`` (imported on the first run), or the function itself;
            ``loop(stage) -> strategy | None``.
        description: one line for ``rltk list stage``.
        provides: what the loop serves the config's components, checked by ``rltk validate`` and ``rltk run``
            before anything heavy starts. Keys (each left out is not checked): ``batch_fields`` (the fields
            an advantage estimator may name), ``buffer_sources`` (what a sample strategy may read),
            ``expert_data`` (it loads ``buffer.expert.path`` into the buffer; default false),
            ``trainer_modes`` (the ``trainer.mode`` values it runs; ``sync`` alone when left out),
            ``on_policy_update`` (its update may take ``old_logprobs`` from its own forward, where its loop reads
            ``parts.on_policy``; default true: false for a loop that always runs the old-log-prob pass).
            The step plan (:class:`rltk.config.recipe_capabilities.StepPlan`) reads the fields and the
            components' signatures together: who fills what, and what nothing fills.
            :func:`rl_provides` builds it for a loop on ``rl_steps``.
        rl: the loop samples from the rollout workflow every step; a recipe of the stage's name runs it as
            its ``type: rl`` stage (:func:`rltk.recipes.recipe_stages`).
        chainable: it may be named in any run's ``stages`` (false: only its own recipe runs it, e.g.
            ``reward_model``, which trains a model that is not the policy).
        check: what the loop refuses in its config, for ``rltk validate`` and ``rltk run`` to refuse before
            any stage runs: ``"package.module:function"`` (or the function), called with the stage's config
            (its overrides applied); it raises :class:`rltk.errors.ConfigError` naming the key. Named by
            string, its module is imported to check a config, so it should not import torch.
    """

    loop: str | Callable
    description: str = ""
    provides: Mapping[str, Any] = field(default_factory=dict)
    rl: bool = False
    chainable: bool = True
    check: str | Callable | None = None

    def __post_init__(self):
        unknown = sorted(set(self.provides) - set(PROVIDES_KEYS))
        if unknown:
            raise ValueError(f"StageSpec provides {unknown}: the keys are {', '.join(PROVIDES_KEYS)}")
        for what, target in (("loop", self.loop), ("check", self.check)):
            if isinstance(target, str) and ":" not in target:
                raise ValueError(f"StageSpec {what} {target!r}: name it 'package.module:function'")
        # `rltk list` shows the first line of a component's docstring: this spec's description
        object.__setattr__(self, "__doc__", self.description or getattr(self.loop, "__doc__", None))

    def resolve(self) -> Callable:
        """The loop function (imported here the first time, when given as ``"module:function"``)."""
        if not isinstance(self.loop, str):
            return self.loop
        module, _, name = self.loop.partition(":")
        return getattr(importlib.import_module(module), name)

    def check_config(self, cfg) -> None:
        """Run the stage's own :attr:`check` on ``cfg``, the stage's config (nothing without one)."""
        if self.check is None:
            return
        check = self.check
        if isinstance(check, str):
            module, _, name = check.partition(":")
            check = getattr(importlib.import_module(module), name)
        check(cfg)

    def __call__(self, stage):
        return self.resolve()(stage)

    def fields(self, key: str) -> frozenset[str] | None:
        """``provides[key]`` as a set, or None where the stage does not declare it."""
        return frozenset(self.provides[key]) if key in self.provides else None

