"""Held-out evaluation of the current policy, each process taking its share of the rows.

Greedy metrics (``eval/*``), one sample per prompt at the training temperature
(``eval/sampled_accuracy``), and the probe the supervised warm-up stops on.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from omegaconf import DictConfig

from rltk.distributed import data_coordinates, every_data_rank
from rltk.training.scaffold.setup import sampling_params


def evaluate(workflow, rows: list[dict], cfg: DictConfig) -> dict[str, float]:
    """Held-out metrics of the current policy: greedy (``eval/*``) and one sample per
    prompt at the training temperature (``eval/sampled_accuracy``, what RL sharpens first).

    With several processes each data rank evaluates its share of the rows (``rows[rank::world]`` in data
    coordinates: the ranks of a sequence- or tensor-parallel group evaluate the same rows together) and
    the results are combined, weighted by responses: every rank returns the numbers of the whole held-out
    set, ``eval/num_responses`` included.
    """
    rows = rows[: cfg.trainer.eval_size or len(rows)]
    world, rank = data_coordinates()
    share = rows[rank::world]
    greedy = workflow.evaluate(share, sampling_params(cfg, greedy=True)) if share else {}
    with seeded_sampling(cfg.trainer.get("eval_seed"), rank):
        sampled = workflow.evaluate(share, dataclasses.replace(sampling_params(cfg), n=1)) if share else {}
    greedy, sampled = _combine_over_ranks(greedy, world), _combine_over_ranks(sampled, world)
    result = {f"eval/{k}": float(v) for k, v in greedy.items()}
    result["eval/sampled_accuracy"] = float(sampled["accuracy"])
    return result


@contextlib.contextmanager
def seeded_sampling(seed: int | None, rank: int = 0):
    """With a seed: torch's random streams (CPU, and every GPU) start from ``seed + rank`` inside, and are
    back where they were after, so a sampled evaluation of the same weights repeats its draws and leaves
    the training's draws as they would have been without it (``trainer.eval_seed``). ``None``: no change."""
    if seed is None:
        yield
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + rank)
        yield


def probe(workflow, rows: list[dict], cfg: DictConfig, *, sampled: bool = False) -> dict[str, float]:
    """The workflow's evaluation of ``rows`` (``accuracy``, ``truncated_fraction`` ...), each process
    taking its share, combined over processes: greedy, or (``sampled``) one answer per row at the
    training temperature, seeded by ``trainer.eval_seed`` as :func:`evaluate`'s sampled pass is."""
    world, rank = data_coordinates()
    share = rows[rank::world]
    if not share:
        return _combine_over_ranks({}, world)
    if sampled:
        with seeded_sampling(cfg.trainer.get("eval_seed"), rank):
            metrics = workflow.evaluate(share, dataclasses.replace(sampling_params(cfg), n=1))
    else:
        metrics = workflow.evaluate(share, sampling_params(cfg, greedy=True))
    return {k: float(v) for k, v in _combine_over_ranks(metrics, world).items()}


def _combine_over_ranks(metrics: dict[str, float], world: int) -> dict[str, float]:
    """Every rank's evaluation means as one: weighted by ``num_responses``, which is summed."""
    if world == 1:
        return metrics
    ranks = [m for m in every_data_rank(metrics) if m]  # a rank with no held-out row contributes nothing
    total = sum(m["num_responses"] for m in ranks)
    combined = {k: sum(m[k] * m["num_responses"] for m in ranks) / total for k in ranks[0]}
    combined["num_responses"] = total
    return combined
