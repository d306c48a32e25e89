"""What a recipe serves its components, and whether it serves the ones a config chooses.

A recipe declares the batch fields and buffer sources it fills
(:class:`RecipeSpec`); an advantage estimator needs the batch fields its
signature requires (:func:`required_batch_fields`) and a sample strategy reads
the buffer sources it names, so validation can refuse a component the recipe
cannot feed (an estimator that needs ``values`` under a critic-free recipe).

:class:`StepPlan` is the one place that says which pass of an RL step fills which batch field and which
fields each component reads, built once per stage from the config, the stage's ``provides`` and the
components' signatures: the rollout plan, the old-log-prob pass (``sum_pi_squared``, or none at all when the
update may take the old log-probs itself), the stage loops and ``rltk validate`` all read it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rltk.batch_types import BATCH_FIELDS
from rltk.config.components import signature_params
from rltk.errors import ConfigError
from rltk.registry import KINDS, get_registry


@dataclass(frozen=True)
class RecipeSpec:
    """What a recipe serves its components, so validation can refuse one it cannot feed.

    Built from the registered stages a recipe runs (:class:`rltk.StageSpec`'s ``provides``; see
    :func:`rltk.recipe_tools.validation.recipe_spec`). ``None`` means "not declared": nothing is checked against it.

    Attributes:
        name: the recipe's name (its script's stem), for messages.
        batch_fields: the batch fields its advantage step hands the estimator
            (an estimator that needs ``values`` needs a recipe with a critic).
        buffer_sources: the buffer sources it puts experiences in (``policy``;
            a sample strategy that reads ``expert`` needs a recipe that fills it).
        expert_data: it puts the experiences of ``buffer.expert.path`` in the
            buffer under ``buffer.expert.source`` (when a path is set).
        others: the specs of sibling recipes, to suggest one that serves what is missing.
        trainer_modes: the ``trainer.mode`` values its loop runs (``None``: ``sync`` only).
        stage_types: the ``stages[i].type`` values it runs: ``rl`` (its own loop) and the registered stages
            (``None``: not declared, checked against the registered stages).
        stage_recipes: ``(type, spec)`` of each registered stage that declares what it provides, so a stage is
            checked against what its own loop serves.
    """

    name: str
    batch_fields: frozenset[str] | None = None
    buffer_sources: frozenset[str] | None = None
    others: tuple["RecipeSpec", ...] = ()
    expert_data: bool = False
    trainer_modes: frozenset[str] | None = None
    stage_types: frozenset[str] | None = None
    stage_recipes: tuple[tuple[str, "RecipeSpec"], ...] = ()


def required_batch_fields(advantage_fn: Any) -> frozenset[str]:
    """The batch fields an advantage estimator cannot run without: its required parameters that are batch fields.

    An estimator declares what it needs by naming batch fields in its
    signature; a field with a default is optional, so it is not required here.
    """
    params, _ = signature_params(advantage_fn)
    return frozenset(
        n for n, p in params.items()
        if p.default is inspect.Parameter.empty and n in KINDS["advantage_fn"].provided
    )


#: The pass of an RL step that fills each batch field a stage may provide besides the rollout's own
#: (:data:`rltk.registration.stage_spec.RL_STEP_FIELDS`), as :meth:`StepPlan.describe` names it. A field a plugin stage
#: declares that is none of these is its loop's.
ROLLOUT_PASS = "rollout"
FIELD_PASSES: dict[str, str] = {
    "baseline_scores": "rollout, one greedy response per prompt",
    "reward_components": "reward, each reward function's own score",
    "old_logprobs": "old-log-prob pass",
    "sum_pi_squared": "old-log-prob pass",
    "ref_logprobs": "reference pass",
    "values": "critic pass",
    "teacher_logprobs": "teacher pass",
}
#: Fields filled only when the estimator asks: those that cost a pass or a column of their own (a greedy
#: rollout, each reward's score) when it requires them; ``sum_pi_squared``, a by-product of the old-log-prob
#: pass, whenever it names it.
ON_DEMAND_IF_REQUIRED = ("baseline_scores", "reward_components")
ON_DEMAND_IF_NAMED = ("sum_pi_squared",)
UPDATE_FORWARD = "the update's own forward (on-policy)"
ENGINE_LOGPROBS = "rollout engine's log-probs (algorithm.use_rollout_logprobs)"


def update_may_take_old_logprobs(estimator_names: frozenset[str] | None, *, ppo_epochs: int, mini_batches: int,
                                 use_rollout_logprobs: bool, rollout_correction: Mapping, kl_coef: float,
                                 kl_in: str) -> bool:
    """Whether the update may take ``old_logprobs`` from its own training forward (detached) instead of a
    separate no-grad pass of the policy before it.

    With one epoch over one mini-batch the only optimizer step comes after the one training forward, so
    the policy that forward evaluates is the policy that sampled the batch: ``pi_old = pi_theta.detach()``
    and the PPO ratio is exactly 1 (as in the on-policy case of Schulman et al. 2017, arXiv:1707.06347).
    The pass before the update is then a forward whose result is already known. It is still needed when

    * ``ppo_epochs > 1`` or ``mini_batches > 1``: later mini-batches train a policy that has moved;
    * ``use_rollout_logprobs``: the old log-probs are the engine's, not this policy's;
    * a rollout-correction mode or ``log_metrics`` is on: both compare old with rollout log-probs before
      the update (the weights and the narrowed mask are fixed before the first forward);
    * the estimator names ``old_logprobs`` or ``sum_pi_squared`` (``estimator_names``; None: its signature
      cannot be read, so it may): advantages come before the update;
    * a KL penalty is folded into the rewards (``kl_in == "reward"`` with ``kl_coef > 0``): it needs
      ``old_logprobs`` before the advantages.

    One difference remains where the policy is not deterministic in training mode (dropout): the
    training forward's log-probs are then those of the dropped-out network, which the recompute (in
    eval mode) is not. rltk's models train without dropout.
    """
    if ppo_epochs != 1 or mini_batches != 1 or use_rollout_logprobs:
        return False
    correction = dict(rollout_correction or {})
    if any(correction.get(mode) is not None for mode in ("tis", "mis", "rejection")) or correction.get("log_metrics"):
        return False
    if estimator_names is None or {"old_logprobs", "sum_pi_squared"} & estimator_names:
        return False
    return not (kl_coef > 0 and kl_in == "reward")


def _batch_params(obj: Any, kind: str) -> tuple[frozenset[str] | None, frozenset[str]]:
    """The batch fields ``obj``'s signature names (None: it cannot be read) and those it requires."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None, frozenset()
    fields = KINDS[kind].provided
    named = frozenset(n for n in params if n in fields)
    return named, frozenset(n for n in named if params[n].default is inspect.Parameter.empty)


@dataclass(frozen=True)
class StepPlan:
    """Which pass of an RL step fills which batch field, and which fields each component reads.

    Built once per stage by :meth:`build` from the stage's config, what its loop ``provides``
    (:class:`rltk.StageSpec`) and the signatures of the chosen components (advantage estimator, policy loss,
    KL estimator): a component that needs a field names it in its signature, a stage whose loop fills one
    declares it, and nothing else changes. The rollout plan (a greedy baseline, each reward's column), the
    old-log-prob pass (``sum_pi_squared``; skipped when the update takes the old log-probs itself), the loops
    and ``rltk validate`` (:meth:`describe`; a field nothing fills is :func:`check_recipe_serves`'s error) read it.

    Attributes:
        stage: the stage's type, for messages.
        fills: ``(field, pass)`` in the order a step runs its passes.
        reads: ``(component, fields)``: the batch fields each component's signature names.
        unfilled: ``(field, component)``: a field a component requires that no pass of the stage fills,
            the component as ``'config.key'='name'``.
        old_logprobs_from_update: the update takes ``old_logprobs`` from its own training forward
            (:func:`update_may_take_old_logprobs`, where the stage's loop allows it: ``on_policy_update``, true
            unless declared false).
    """

    stage: str
    fills: tuple[tuple[str, str], ...] = ()
    reads: tuple[tuple[str, tuple[str, ...]], ...] = ()
    unfilled: tuple[tuple[str, str], ...] = ()
    old_logprobs_from_update: bool = False

    @classmethod
    def build(cls, cfg: DictConfig, provides: Mapping | None = None, stage: str = "rl") -> "StepPlan":
        """The plan of the RL stage ``stage`` whose config is ``cfg`` and whose loop ``provides`` what it says
        (None, or no ``batch_fields``: not declared, so every field a component names counts as filled by
        its usual pass and nothing is unfilled)."""
        from rltk.registration.stage_spec import RL_STEP_FIELDS

        a = cfg.algorithm
        entries = get_registry().entries
        provides = dict(provides or {})
        declared = provides.get("batch_fields")
        available = frozenset(KINDS["advantage_fn"].provided if declared is None else declared)
        estimator = f"'algorithm.advantage_fn'='{a.advantage_fn}'"
        named, required = _batch_params(entries["advantage_fn"][a.advantage_fn].described, "advantage_fn")
        old_from_update = bool(provides.get("on_policy_update", True)) and update_may_take_old_logprobs(
            named, ppo_epochs=cfg.trainer.ppo_epochs, mini_batches=cfg.trainer.mini_batches,
            use_rollout_logprobs=a.use_rollout_logprobs, kl_coef=a.kl_coef, kl_in=a.kl_in,
            rollout_correction=OmegaConf.to_container(a.rollout_correction, resolve=True))
        asks = required | ({f for f in ON_DEMAND_IF_NAMED if f in (named or ())})
        kl_in_reward = a.kl_coef > 0 and a.kl_in == "reward" and "ref_logprobs" in available
        fills: dict[str, str] = {f: ROLLOUT_PASS for f in RL_STEP_FIELDS if f != "old_logprobs" and f in available}
        if kl_in_reward and "token_rewards" in fills:
            fills["token_rewards"] = "rollout, then the KL penalty (algorithm.kl_in=reward)"
        fills.update({f: FIELD_PASSES[f] for f in ON_DEMAND_IF_REQUIRED if f in required and f in available})
        fills["old_logprobs"] = (UPDATE_FORWARD if old_from_update else
                                 ENGINE_LOGPROBS if a.use_rollout_logprobs else FIELD_PASSES["old_logprobs"])
        fills.update({f: FIELD_PASSES[f] for f in ON_DEMAND_IF_NAMED if f in asks and f in available})
        if a.kl_coef > 0 and "ref_logprobs" in available:
            fills["ref_logprobs"] = FIELD_PASSES["ref_logprobs"]
        if declared is not None:  # the passes a loop runs whatever the components: what it declares
            fills.update({f: FIELD_PASSES[f] for f in ("values", "teacher_logprobs") if f in available})
            for f in sorted(available - set(fills) - set(FIELD_PASSES) - {"advantages", "returns"}):
                fills[f] = f"stage '{stage}' loop"  # a plugin stage's own field
        fills.update(dict.fromkeys(("advantages", "returns"), f"advantage_fn '{a.advantage_fn}'"))
        unfilled = tuple((f, estimator) for f in sorted(required - available))
        return cls(stage, tuple(fills.items()), _reads(cfg, named, "values" in fills), unfilled,
                   old_from_update)

    def filler(self, field_name: str) -> str | None:
        """The pass that fills ``field_name`` this step, or None when no pass does."""
        return dict(self.fills).get(field_name)

    def fills_field(self, field_name: str) -> bool:
        return field_name in dict(self.fills)

    @property
    def greedy_baseline(self) -> bool:
        """The rollout adds one greedy response per prompt (``baseline_scores``, ReMax)."""
        return self.fills_field("baseline_scores")

    @property
    def reward_components(self) -> bool:
        """The batch carries each reward function's own score (``reward_components``, gdpo)."""
        return self.fills_field("reward_components")

    @property
    def sum_pi_squared(self) -> bool:
        """The old-log-prob pass also returns ``sum_pi_squared`` (optimal_token_baseline)."""
        return self.fills_field("sum_pi_squared")

    def describe(self) -> str:
        """Who fills what, pass by pass, then what each component reads: for ``rltk validate``."""
        passes: dict[str, list[str]] = {}
        for f, by in self.fills:
            passes.setdefault(by, []).append(f)
        width = max(map(len, passes), default=0)
        lines = [f"  {by.ljust(width)}  fills {', '.join(fs)}" for by, fs in passes.items()]
        lines += [f"  {c} reads {', '.join(fs) or 'no batch field'}" for c, fs in self.reads]
        lines += [f"  nothing fills {f}, which {c} needs" for f, c in self.unfilled]
        return "\n".join(lines)


def _reads(cfg: DictConfig, estimator_named: frozenset[str] | None,
           critic: bool) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """What each component of an RL step reads (:attr:`StepPlan.reads`)."""
    a, entries = cfg.algorithm, get_registry().entries
    def fields(named):  # the batch's fields (not the loss_agg a policy loss is handed)
        return tuple(sorted(f for f in named or () if f in BATCH_FIELDS))

    reads = [(f"advantage_fn '{a.advantage_fn}'", fields(estimator_named))]
    named, _ = _batch_params(entries["policy_loss"][a.policy_loss].described, "policy_loss")
    reads.append((f"policy_loss '{a.policy_loss}'", fields(named)))
    if a.kl_coef > 0:
        named, _ = _batch_params(entries["kl_penalty_fn"][a.kl_penalty_fn].described, "kl_penalty_fn")
        reads.append((f"kl_penalty_fn '{a.kl_penalty_fn}' (in the {a.kl_in})", fields(named)))
    if critic:
        reads.append(("the critic's value loss", ("response_mask", "returns", "values")))
    return tuple(reads)


def check_recipe_serves(cfg: DictConfig, recipe: RecipeSpec, needs: frozenset[str]) -> None:
    """The recipe fills the batch fields the advantage estimator needs and the buffer sources the strategy reads."""
    registry = get_registry()
    # what nothing fills, by the step plan of what the recipe's loop provides
    unfilled = StepPlan.build(cfg, {"batch_fields": recipe.batch_fields}, recipe.name).unfilled \
        if recipe.batch_fields is not None else ()
    if unfilled:
        missing = [f for f, _ in unfilled]
        name = cfg.algorithm.advantage_fn
        preset = registry.entries["algorithm"][cfg.algorithm.name].obj
        via = (f" (the advantage_fn of algorithm.name='{cfg.algorithm.name}')"
               if dict(preset).get("advantage_fn") == name else "")
        servers = [r.name for r in recipe.others if r.batch_fields is not None and needs <= r.batch_fields]
        fits = sorted(
            n for n, e in registry.entries["advantage_fn"].items()
            if required_batch_fields(e.described) <= recipe.batch_fields
        )
        where = f"`rltk run {servers[0]}`" if servers else "a recipe that provides it"
        raise ConfigError(
            f"'algorithm.advantage_fn'='{name}'{via} needs batch field(s) {', '.join(map(repr, missing))}, which "
            f"recipe '{recipe.name}' does not provide"
            f"{' (it trains no critic)' if 'values' in missing else ''}. Use {where}, or an advantage_fn "
            f"that recipe '{recipe.name}' can serve: {', '.join(fits)}"
        )
    expert = cfg.buffer.expert
    if expert.path and not recipe.expert_data:
        servers = ", ".join(r.name for r in recipe.others if r.expert_data)
        raise ConfigError(
            f"'buffer.expert.path'='{expert.path}' is set, but recipe '{recipe.name}' does not load expert data "
            f"into its buffer{f' (recipes that do: {servers})' if servers else ''}; unset it"
        )
    if recipe.buffer_sources is None:
        return
    name = cfg.buffer.sample_strategy
    cls = registry.entries["sample_strategy"][name].described
    reads = getattr(cls, "buffer_sources", None)
    if not callable(reads):
        return
    args = dict(OmegaConf.to_container(cfg.buffer.sample_strategy_args, resolve=True) or {})
    try:
        sources = frozenset(reads(**args))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"'buffer.sample_strategy_args' of sample strategy '{name}': {exc}") from exc
    filled = recipe.buffer_sources | ({expert.source} if expert.path and recipe.expert_data else set())
    missing = sorted(sources - filled)
    if expert.path and expert.source not in sources and missing:
        raise ConfigError(
            f"'buffer.expert.source'='{expert.source}' (where the experiences of buffer.expert.path go) is not the "
            f"source 'buffer.sample_strategy'='{name}' reads ({', '.join(map(repr, missing))}): set "
            f"buffer.expert.source='{missing[0]}', or the strategy's source to '{expert.source}'"
        )
    if expert.path and expert.source not in sources:
        raise ConfigError(
            f"'buffer.expert.path'='{expert.path}' puts expert experiences under buffer source '{expert.source}' "
            f"(buffer.expert.source), but 'buffer.sample_strategy'='{name}' never reads that source (it reads "
            f"{', '.join(map(repr, sorted(sources)))}), so they would be loaded and ignored. Use a strategy that "
            f"mixes them in (buffer.sample_strategy=mix_expert), or unset buffer.expert.path"
        )
    if recipe.expert_data and missing:
        raise ConfigError(
            f"'buffer.sample_strategy'='{name}'{f' with buffer.sample_strategy_args={args}' if args else ''} reads "
            f"experiences of buffer source(s) {', '.join(map(repr, missing))}, which recipe '{recipe.name}' fills "
            f"only from a dataset of expert responses: set buffer.expert.path=<a json/jsonl/parquet/csv file or "
            f"datasets folder with prompt and response columns> and buffer.expert.source='{missing[0]}'"
        )
    if missing:
        servers = [r.name for r in recipe.others if r.buffer_sources is not None and sources <= r.buffer_sources]
        where = f"recipe '{servers[0]}'" if servers else "a recipe script that puts them in"
        raise ConfigError(
            f"'buffer.sample_strategy'='{name}'{f' with buffer.sample_strategy_args={args}' if args else ''} reads "
            f"experiences of buffer source(s) {', '.join(map(repr, missing))}, which recipe '{recipe.name}' never "
            f"fills (it fills "
            f"{', '.join(map(repr, sorted(recipe.buffer_sources)))}). Use {where} "
            f"(buffer.put(experiences, step, source='{missing[0]}')), or a sample strategy that reads only what "
            f"the recipe fills, e.g. buffer.sample_strategy=on_policy"
        )


def check_workflow_serves(cfg: DictConfig, needs: frozenset[str]) -> None:
    """The workflow can produce ``baseline_scores`` when the advantage estimator needs them.

    The recipes ask the workflow for one greedy response per prompt with
    ``run(rows, greedy_baseline=True)``; a workflow whose ``run`` takes no
    ``greedy_baseline`` cannot serve such an estimator (ReMax).
    """
    if "baseline_scores" not in needs:
        return
    name = cfg.rollout.workflow
    cls = get_registry().entries["workflow"][name].described
    try:
        params = inspect.signature(cls.run).parameters
    except (AttributeError, TypeError, ValueError):
        return
    if "greedy_baseline" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        raise ConfigError(
            f"'algorithm.advantage_fn'='{cfg.algorithm.advantage_fn}' needs batch field 'baseline_scores' (the "
            f"score of a greedy response to each prompt), which 'rollout.workflow'='{name}' cannot produce: its "
            f"run() takes no greedy_baseline argument. Use rollout.workflow=single_turn, or an advantage_fn "
            f"with a baseline of its own (e.g. grpo, rloo)"
        )
