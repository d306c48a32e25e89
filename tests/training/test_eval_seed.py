"""trainer.eval_seed: a sampled evaluation of the same weights gives the same number, and leaves the
run's random stream where it was (issue 29, item 7)."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from rltk.config.schema import RunConfig
from rltk.training.scaffold.evaluation import evaluate


class DrawingWorkflow:
    """Greedy is deterministic; a sampled evaluation draws from torch's global stream, as the hf engine does."""

    def evaluate(self, rows, params):
        accuracy = 1.0 if params.greedy else torch.rand(len(rows)).lt(0.5).float().mean().item()
        return {"accuracy": accuracy, "num_responses": float(len(rows))}


def config(eval_seed):
    cfg = OmegaConf.structured(RunConfig)
    cfg.trainer.eval_seed = eval_seed
    return cfg


def test_a_seeded_sampled_evaluation_repeats_itself_and_leaves_the_training_stream_alone():
    rows, workflow = [{}] * 64, DrawingWorkflow()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = evaluate(workflow, rows, config(7))
    assert torch.equal(torch.get_rng_state(), before)  # the training's next draws are what they were
    torch.rand(10)  # training moves the stream on between evaluations
    assert evaluate(workflow, rows, config(7)) == first
    assert evaluate(workflow, rows, config(8))["eval/sampled_accuracy"] != first["eval/sampled_accuracy"]


def test_without_a_seed_the_evaluation_draws_from_the_runs_stream():
    rows, workflow = [{}] * 64, DrawingWorkflow()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    evaluate(workflow, rows, config(None))
    assert not torch.equal(torch.get_rng_state(), before)
