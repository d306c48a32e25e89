"""What a recipe serves its components, and whether it serves the ones a config chooses.

A recipe declares the batch fields and buffer sources it fills
(:class:`RecipeSpec`); an advantage estimator needs the batch fields its
signature requires (:func:`required_batch_fields`) and a sample strategy reads
the buffer sources it names, so validation can refuse a component the recipe
cannot feed (an estimator that needs ``values`` under a critic-free recipe).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rltk.config.components import signature_params
from rltk.errors import ConfigError
from rltk.registry import KINDS, get_registry


@dataclass(frozen=True)
class RecipeSpec:
    """What a recipe serves its components, so validation can refuse one it cannot feed.

    Built from the registered stages a recipe runs (:class:`rltk.StageSpec`'s ``provides``; see
    :func:`rltk.recipe_validation.recipe_spec`). ``None`` means "not declared": nothing is checked against it.

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


def check_recipe_serves(cfg: DictConfig, recipe: RecipeSpec, needs: frozenset[str]) -> None:
    """The recipe fills the batch fields the advantage estimator needs and the buffer sources the strategy reads."""
    registry = get_registry()
    if recipe.batch_fields is not None and not needs <= recipe.batch_fields:
        missing = sorted(needs - recipe.batch_fields)
        name = cfg.algorithm.advantage_fn
        preset = registry.entries["algorithm"][cfg.algorithm.name].obj
        via = (f" (the advantage_fn of algorithm.name='{cfg.algorithm.name}')"
               if dict(preset).get("advantage_fn") == name else "")
        servers = [r.name for r in recipe.others if r.batch_fields is not None and needs <= r.batch_fields]
        fits = sorted(
            n for n, e in registry.entries["advantage_fn"].items()
            if required_batch_fields(e.obj) <= recipe.batch_fields
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
    cls = registry.entries["sample_strategy"][name].obj
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
    cls = get_registry().entries["workflow"][name].obj
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
