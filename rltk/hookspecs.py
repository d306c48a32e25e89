"""Every hook point of rltk, one documented empty function each.

A plugin is any module with functions decorated by ``rltk.hookimpl`` whose
names match the specs below; it reaches rltk through an entry point in the
group ``rltk`` (builtins come in exactly the same way, see rltk's own
``pyproject.toml``). An implementation may accept fewer arguments than its
spec offers, so specs can grow without breaking plugins.

Component hooks take no arguments and return ``{name: component}``. The
returned names are what configs refer to (``algorithm.advantage_fn=rloo``).
Two plugins returning one name is an error naming both, unless the later one
wraps its component in :func:`rltk.override`. Registration also refuses, naming
the plugin: a component that is not callable (a preset that is not a dict), a
function named ``rltk_*`` that matches no spec below (a typo would register
nothing), an implementation with a required argument its spec does not pass,
and a lifecycle hook without ``@rltk.hookimpl`` (it would never be called).
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("rltk")


# --------------------------------------------------------------------------
# Algorithm math (pure tensor functions, see rltk/algorithms)
# --------------------------------------------------------------------------


@hookspec
def rltk_advantage_fns() -> dict:
    """Register advantage estimators (kind ``advantage_fn``).

    Called once when the registry loads. Return ``{name: fn}``; ``fn`` is
    called with keyword arguments only: the batch fields it names in its
    signature (``token_rewards``, ``response_mask``, ``group_ids``,
    ``values``, ``scores``, ``old_logprobs`` ...; ``reward_components`` and
    ``sum_pi_squared``, which the recipes fill only for an estimator that
    names them; ``sequence_rewards`` and ``policy_lengths``, the ``[B]`` row
    sums of ``token_rewards`` and ``response_mask``, which spare an outcome
    estimator a ``[B, T]`` pass) plus its configured arguments, and returns ``(advantages,
    returns)``, both ``[B, T]``: ``advantages`` a new tensor, zero outside the
    mask; ``returns`` right on every policy token, and outside the mask either 0
    or (the builtin outcome estimators) a read-only broadcast view holding
    ``R_i`` (see "What consumers may rely on" in
    :mod:`rltk.algorithms.advantages`). A required field the recipe does not
    fill is a validation error naming it.
    """


@hookspec
def rltk_kl_penalty_fns() -> dict:
    """Register KL penalty estimators (kind ``kl_penalty_fn``).

    Return ``{name: fn}`` with ``fn(logprobs, ref_logprobs, **args) -> [B, T]``
    giving a per-token KL estimate. An estimator that corrects for off-policy
    samples may also take ``old_logprobs=`` (the behaviour policy's log-probs
    of the same tokens, passed by the caller, never set in a config).
    """


@hookspec
def rltk_loss_aggs() -> dict:
    """Register loss aggregations (kind ``loss_agg``).

    Return ``{name: fn}`` with ``fn(loss_mat, mask, **normalisers) -> scalar``;
    the normalisers carry global token and sequence counts so gradient
    accumulation and data parallelism match one big batch.
    """


@hookspec
def rltk_reward_model_losses() -> dict:
    """Register reward-model losses (kind ``reward_model_loss``, config key ``reward_model.loss``).

    Return ``{name: fn}`` with ``fn(*, chosen_rewards, rejected_rewards, **args) -> (loss, metrics)``:
    the scalar rewards ``[B]`` of the preferred and the dispreferred response of each pair.
    """


@hookspec
def rltk_policy_losses() -> dict:
    """Register policy losses (kind ``policy_loss``).

    Return ``{name: fn}`` with ``fn(*, logprobs, old_logprobs, advantages,
    response_mask, loss_agg, **args) -> (loss, metrics)``. A loss may also
    take ``behaviour_logprobs`` (the log-probs the rollout engine sampled
    with, per token, when ``old_logprobs`` are the proximal policy's: the
    decoupled objective), filled in by the caller, never set in a config.
    """


@hookspec
def rltk_preference_losses() -> dict:
    """Register preference losses (kind ``preference_loss``): the DPO family.

    Return ``{name: fn}`` with ``fn(*, chosen_logps, rejected_logps,
    ref_chosen_logps, ref_rejected_logps, beta, **args) -> losses``: each
    input ``[P]`` (a response's summed log-prob under the policy, with
    gradient, or under the frozen reference), the result the ``[P]``
    per-pair losses (see :mod:`rltk.algorithms.preference_losses`).
    """


@hookspec
def rltk_algorithms() -> dict:
    """Register algorithm presets (kind ``algorithm``).

    Return ``{name: preset}`` where a preset is a plain dict of defaults for
    the ``algorithm`` config section (e.g. ``grpo`` chooses the ``grpo``
    advantage, ``ppo_clip`` loss and ``k3`` KL). User config wins over a
    preset, a preset wins over the schema defaults.
    """


# --------------------------------------------------------------------------
# Rewards and workflows
# --------------------------------------------------------------------------


@hookspec
def rltk_reward_fns() -> dict:
    """Register reward functions (kind ``reward_fn``).

    Return ``{name: fn}`` with ``fn(*, prompt, response, ground_truth,
    extras, **args) -> float | dict[str, float]``. A dict names several
    scores; its ``"score"`` entry (or the sum) is the reward.

    Unless marked :func:`rltk.rewards.bounded` (work capped on any input,
    run in-process), ``fn`` runs in worker processes under
    ``reward.timeout_s``, so it must be importable: a top-level function of
    the plugin's module, not a lambda or closure.
    """


@hookspec
def rltk_workflows() -> dict:
    """Register workflows (kind ``workflow``): task rows -> experiences.

    Return ``{name: cls}``; the recipe constructs ``cls(engine=...,
    tokenizer=..., reward=..., sampling=..., **args)`` and calls
    ``run(rows) -> list[rltk.batch.Experience]``, or ``run(rows,
    greedy_baseline=True)`` when the advantage estimator needs
    ``baseline_scores`` (a workflow without that argument cannot serve it).
    """


@hookspec
def rltk_agents() -> dict:
    """Register agents (kind ``agent``) for the ``agentic`` workflow.

    Return ``{name: fn}`` with ``fn(row, client, model, **agent_args) ->
    float | None``: ``client`` is an ``openai.OpenAI`` client pointed at the
    endpoint rltk serves from the rollout engine (its requests carry the
    episode's session id), ``model`` the model id to pass. Return the
    episode's reward, or ``None`` for the reward function to score the last
    completion. Called from several threads at once, one episode each.
    """


# --------------------------------------------------------------------------
# Multi-turn episodes: environments, tools, tool-call parsers
# --------------------------------------------------------------------------


@hookspec
def rltk_environments() -> dict:
    """Register environments (kind ``environment``) of multi-turn episodes.

    Return ``{name: cls}``, ``cls`` a subclass of
    :class:`rltk.environments.base.Environment`; the ``multi_turn`` workflow
    builds ``cls(**env.environment_args)`` once per episode and calls
    ``reset(row)``, then ``step(turn)`` per assistant turn, then ``close()``.
    """


@hookspec
def rltk_tools() -> dict:
    """Register tools the policy can call (kind ``tool``).

    Return ``{name: tool}``, ``tool`` a :class:`rltk.tools.base.Tool` (the
    ``rltk.tools.base.tool`` decorator makes one from a function). Its
    ``schema()`` is rendered through the chat template's ``tools=``;
    ``env.tools_args.<name>`` binds its configured arguments.
    """


@hookspec
def rltk_tool_parsers() -> dict:
    """Register tool-call parsers (kind ``tool_parser``).

    Return ``{name: cls}``; ``cls(**env.tool_parser_args).parse(text)`` returns
    ``(content, calls, error)`` and never raises on model output (see
    :mod:`rltk.tools.parsers`).
    """


# --------------------------------------------------------------------------
# Buffer, training strategies, rollout engines, loggers
# --------------------------------------------------------------------------


@hookspec
def rltk_sample_strategies() -> dict:
    """Register sample strategies (kind ``sample_strategy``).

    Return ``{name: cls}``; ``cls(**args).sample(buffer, step)`` decides which
    experiences the trainer reads next. An optional classmethod
    ``cls.buffer_sources(**args) -> set[str]`` names the buffer sources it
    reads, so validation can refuse it under a recipe that never fills them.
    """


@hookspec
def rltk_training_strategies() -> dict:
    """Register training strategies (kind ``training_strategy``).

    Return ``{name: cls}``; a strategy wraps model, optimizer and scheduler
    (forward/backward/step, accumulation, clipping, save/load, full weights
    for the rollout engine). See rltk/strategies/base.py.
    """


@hookspec
def rltk_rollout_engines() -> dict:
    """Register rollout engines (kind ``rollout_engine``).

    Return ``{name: cls}``; an engine turns prompt token ids and sampling
    parameters into completions and accepts new weights from the trainer.
    See rltk/rollout/base.py.
    """


@hookspec
def rltk_loggers() -> dict:
    """Register metric loggers (kind ``logger``).

    Return ``{name: cls}``; ``cls(run_dir=..., config=..., total_steps=...,
    **args)`` gets ``log(metrics, step)`` and ``close()`` calls.
    """


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


@hookspec
def rltk_tasks() -> dict:
    """Register synthetic tasks (kind ``task``), chosen by ``data.task``.

    Return ``{name: fn}`` with ``fn(split, size, seed, **args) -> list[row]``:
    ``split`` is ``"train"`` or ``"test"`` (the held-out split; the two must
    never share a problem whatever the seeds), ``size`` the number of rows,
    ``seed`` which rows are drawn, ``args`` the task's keyword arguments from
    ``data.task_args`` (validated against ``fn``'s signature). A row is
    ``{"prompt": str, "ground_truth": str, "extras": dict, "id": str}``
    (see :mod:`rltk.data.loading`), or carries chat messages instead of or
    beside the prompt: ``"messages"`` (the opening messages of an episode)
    and, for the supervised warm-up, ``"sft_messages"`` (a whole
    demonstration transcript: the opening messages, then assistant turns,
    tool results and environment feedback; the loss covers the assistant
    turns only). Without ``sft_messages`` the warm-up teaches
    ``extras["solution"]`` (else the ground truth) as the response to the prompt.
    """


# --------------------------------------------------------------------------
# Training loops
# --------------------------------------------------------------------------


@hookspec
def rltk_stages() -> dict:
    """Register training loops (kind ``stage``), chosen by ``stages[i].type``.

    Return ``{name: rltk.StageSpec(loop, description, provides=...)}``. ``loop`` is
    ``"package.module:function"`` (imported when the stage first runs, so listing and
    validating never import it) or the function itself; it is called as ``loop(stage)``
    with the running :class:`rltk.training.stages.run.Stage` and returns the training
    strategy holding the trained policy (see :func:`rltk.training.stages.run.run_stages`).
    ``provides`` says what its steps serve the config's components (batch fields, buffer
    sources, expert data, trainer modes), which ``rltk validate`` checks the config against.
    The builtins (sft, grpo, ppo, dpo, distill, reward_model) are ``rltk.components.builtin_stages``.
    """


# --------------------------------------------------------------------------
# Lifecycle (called by recipes through rltk.call_lifecycle_hook; every
# implementation runs, the last registered first). A lifecycle hook may stop a
# run: an exception it raises ends the run as rltk.LifecycleHookError naming
# the plugin, the hook and the step (exit code 1 under `rltk run`), with the
# checkpoints written so far kept for a resume. A hook that must never stop
# training catches its own errors.
# --------------------------------------------------------------------------


@hookspec
def rltk_on_train_start(config, run_dir) -> None:
    """Called once by a recipe after everything is built, before step 1.

    ``config`` is the resolved OmegaConf config, ``run_dir`` a ``Path``.
    """


@hookspec
def rltk_on_step_end(step, metrics) -> None:
    """Called once at the end of every training step of every stage, with its metrics, before they are logged.

    ``step`` counts on across a run's stages (the global step of ``metrics.jsonl``: an SFT warm-up of 100
    steps ends at step 100, the RL stage after it runs steps 101...). A step is one update of the stage's
    model, however many optimizer steps it takes (PPO's epochs and mini-batches, a critic's update); a step
    whose batch came up empty (``skipped_empty_batch``) still ends and calls it. ``metrics`` is the step's
    row, its evaluation included on an evaluation step. A stage's opening evaluation is no step and does
    not call it. As HF Trainer's ``on_step_end`` and Lightning's ``on_train_batch_end``: one call per step.

    Implementations may add entries to ``metrics`` before it is logged.
    """


@hookspec
def rltk_on_checkpoint(step, path) -> None:
    """Called after a checkpoint for ``step`` was written completely to ``path``."""


@hookspec
def rltk_on_train_end(run_dir, metrics) -> None:
    """Called once when training finished, with the final evaluation metrics."""
