"""A checkpoint's optimizer state laid out for another grouping of the same parameters.

Checkpoints key optimizer state by parameter name (:func:`rltk.strategies.base.optimizer_state_by_name`), so the
tensors are independent of the layout that wrote them, but the parameter *groups* are not: tensor parallelism
splits each AdamW group into one group per device mesh (:func:`rltk.strategies.accelerate_strategy.
split_groups_by_mesh`: tensor-parallel DTensors, FSDP2 shards, plain replicated tensors), a data-parallel run
keeps the decayed and non-decayed groups whole. A checkpoint written at ``tensor_parallel_size=2`` therefore has
more groups than a one-process run builds, and the learning-rate schedule's per-group lists (``base_lrs``,
``_last_lr``, ``lr_lambdas``) follow the groups. :func:`regroup_saved_state` rewrites both for the live
optimizer's grouping when the two name the same parameters with the same hyper-parameters, which is what resuming
at another layout needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

#: keys of a parameter group that say how this layout runs the update, not what the update is: the live
#: optimizer's are kept (a fused kernel chosen for one layout's tensors may not suit another's)
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
#: the learning-rate schedule's lists with one entry per parameter group (``lr_lambdas``: a LambdaLR's
#: per-group multiplier state, e.g. a ``functools.partial``'s)
SCHEDULE_LISTS = ("base_lrs", "_last_lr", "lr_lambdas")


def regroup_saved_state(optimizer: torch.optim.Optimizer, module: nn.Module, saved: dict[str, Any],
                        schedule: dict[str, Any], source: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(saved, schedule)`` for ``optimizer``'s groups: unchanged when they already match, or when the names
    differ (then :func:`~rltk.strategies.base.load_optimizer_state_by_name` reports the mismatch); else one
    saved group per live group, its hyper-parameters those of the saved groups its parameters came from, and
    the schedule's per-group lists taken from the same groups. A ValueError when the parameters of one live
    group had different hyper-parameters in the checkpoint (no one group could hold them)."""
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=True)}
    live = [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
    saved_groups = saved.get("param_groups", [])
    stored = [list(group["params"]) for group in saved_groups]
    if live == stored or sorted(n for g in live for n in g if n) != sorted(n for g in stored for n in g):
        return saved, schedule
    owner = {name: index for index, group in enumerate(stored) for name in group}
    groups, origins = [], []
    for index, (group, live_names) in enumerate(zip(optimizer.param_groups, live)):
        sources = sorted({owner[name] for name in live_names})
        settings = [_hyper_parameters(saved_groups[i]) for i in sources]
        if any(s != settings[0] for s in settings[1:]):
            raise ValueError(
                f"optimizer state in '{source}': the parameters of this run's group {index} come from the "
                f"checkpoint's groups {sources}, whose hyper-parameters differ ({settings}); it was saved with "
                "another optimizer configuration")
        kept = {k: group[k] for k in IMPLEMENTATION_KEYS if k in group}
        groups.append({**(settings[0] if settings else {}), **kept, "params": live_names})
        origins.append(sources[0] if sources else 0)
    schedule = dict(schedule)
    for key in SCHEDULE_LISTS:
        values = schedule.get(key)
        if isinstance(values, list) and len(values) == len(stored):
            schedule[key] = [values[i] for i in origins]
    return {**saved, "param_groups": groups}, schedule


def _hyper_parameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params" and k not in IMPLEMENTATION_KEYS}
