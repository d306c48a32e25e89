"""Batch metrics say which responses they describe: ``rollout/*`` everything the workflow produced (before
the sample strategy), ``reward``/``accuracy``/``batch/*`` the batch the trainer read (after it).

Each test has the two sets differ, so a metric computed on the wrong one fails."""

from __future__ import annotations

import json

import pytest

from rltk.batch import Experience, collate
from rltk.buffer.buffer import ExperienceBuffer
from rltk.buffer.strategies import FilterEqualGroups, OnPolicy
from rltk.commands.cli import main
from rltk.data.sampler import RowSampler
from rltk.training.rollouts.collect import RolloutPlan, collect_experiences
from rltk.training.step.batch_metrics import rollout_metrics


class GroupsWorkflow:
    """Row ``r`` gets a group of experiences scored ``scores[r]`` (response lengths 1, 2, ...)."""

    def __init__(self, scores: dict[str, tuple[float, ...]]):
        self.scores, self._next_group = scores, 0
        self.reward = type("Reward", (), {"stats": staticmethod(lambda: {})})()

    def run(self, rows, **kwargs):
        out = []
        for row in rows:
            for i, s in enumerate(self.scores[row["id"]]):
                out.append(Experience(prompt_ids=[5], response_ids=[7] * (i + 1), score=s, group_id=self._next_group))
            self._next_group += 1
        return out

    def metrics(self):
        return {}


def rows(n):
    return [{"prompt": f"p{i}", "id": f"r{i}"} for i in range(n)]


def step_metrics(workflow, sampler, plan, sample_strategy):
    """One RL step's metrics as the recipes assemble them: collect, buffer, sample strategy, collate, log."""
    experiences, collect_metrics = collect_experiences(workflow, sampler, plan)
    buffer = ExperienceBuffer()
    buffer.put(experiences, 1)
    batch = collate(sample_strategy.sample(buffer, 1), pad_token_id=0)
    return {**rollout_metrics(batch, workflow, sample_strategy, elapsed=1.0), **collect_metrics}


def test_filter_equal_groups_rollout_vs_batch_by_hand():
    # groups: [1, 1] all equal (dropped), [0, 1], [0, 0.5], [0, 0] all equal (dropped)
    workflow = GroupsWorkflow({"r0": (1.0, 1.0), "r1": (0.0, 1.0), "r2": (0.0, 0.5), "r3": (0.0, 0.0)})
    m = step_metrics(workflow, RowSampler(rows(4), 4, shuffle=False), RolloutPlan(), FilterEqualGroups(min_groups=0))
    # before: 8 responses, scores sum 3.5, three of them >= 1
    assert (m["rollout/reward"], m["rollout/accuracy"]) == (3.5 / 8, 3 / 8)
    assert (m["rollout/samples"], m["rollout/groups"]) == (8.0, 4.0)
    # after: the two informative groups, scores 0 1 0 0.5 -> sum 1.5, one solved; lengths 1 2 1 2
    assert (m["reward"], m["accuracy"], m["response_length"]) == (1.5 / 4, 1 / 4, 1.5)
    assert (m["batch/samples"], m["batch/groups"]) == (4.0, 2.0)
    assert m["buffer/groups_dropped"] == 2.0


def test_dynamic_sampling_rounds_count_before_not_after():
    # round 1 (r0, r1): [1, 1] dropped, [0, 1] kept; round 2 (r2, r3): [0, 0] dropped, [0.5, 0] kept -> full
    workflow = GroupsWorkflow({"r0": (1.0, 1.0), "r1": (0.0, 1.0), "r2": (0.0, 0.0), "r3": (0.5, 0.0)})
    m = step_metrics(workflow, RowSampler(rows(4), 2, shuffle=False),
                     RolloutPlan(dynamic_sampling=True, max_rounds=4), OnPolicy())
    assert (m["rollout/reward"], m["rollout/accuracy"], m["rollout/samples"], m["rollout/groups"]) == (
        3.5 / 8, 3 / 8, 8.0, 4.0)
    assert (m["reward"], m["accuracy"], m["batch/samples"], m["batch/groups"]) == (1.5 / 4, 1 / 4, 4.0, 2.0)
    assert m["dynamic_sampling/rounds"] == 2.0


def test_without_filtering_the_two_sets_agree():
    workflow = GroupsWorkflow({"r0": (1.0, 0.0, 0.25), "r1": (2.0, 1.0, 1.0)})
    m = step_metrics(workflow, RowSampler(rows(2), 2, shuffle=False), RolloutPlan(), OnPolicy())
    assert m["rollout/reward"] == m["reward"] == pytest.approx(5.25 / 6)
    assert m["rollout/accuracy"] == m["accuracy"] == 4 / 6
    assert m["rollout/samples"] == m["batch/samples"] == 6.0 and m["rollout/groups"] == m["batch/groups"] == 2.0


@pytest.fixture
def recorded(monkeypatch):
    """Every experience the workflow produced and every batch the trainer read, per RL step."""
    import rltk.training.step.estimator as estimator
    from rltk.workflows.single_turn import SingleTurnWorkflow

    produced, batches = [], []
    run, estimate = SingleTurnWorkflow.run, estimator.Estimator.__call__

    def recording_run(self, rows, **kwargs):
        out = run(self, rows, **kwargs)
        produced.append(out)
        return out

    def recording_advantages(self, batch, strategy=None):
        advantages, returns = estimate(self, batch, strategy)
        batches.append({**{k: v.clone() for k, v in batch.items()}, "advantages": advantages, "returns": returns})
        return advantages, returns

    monkeypatch.setattr(SingleTurnWorkflow, "run", recording_run)
    monkeypatch.setattr(estimator.Estimator, "__call__", recording_advantages)
    return produced, batches


@pytest.mark.slow  # three GRPO steps of the tiny model, no warm-up (~10 s)
def test_grpo_logs_rollout_and_batch_sets_of_the_filtered_step(tmp_path, recorded):
    produced, batches = recorded
    run_dir = tmp_path / "run"
    # overlong_penalty (the example plugin) scores by length, so groups of random responses mostly differ
    # and the equal ones that remain are dropped by the filter: the two sets differ
    assert main(["run", "grpo", f"output_dir={run_dir}", "stages=[{name: rl, type: rl}]", "trainer.total_steps=3",
                 "trainer.warmup_steps=0", "trainer.eval_every=0", "data.train_size=32", "data.eval_size=4",
                 "trainer.prompts_per_step=4", "rollout.n=3", "rollout.max_new_tokens=4",
                 "reward.reward_fn=[exact_match,overlong_penalty]",
                 "reward.reward_fn_args={overlong_penalty: {max_length: 4, buffer_length: 2}}",
                 "buffer.sample_strategy=filter_equal_groups", "buffer.sample_strategy_args={min_groups: 1}",
                 "checkpoint.resume=never", "checkpoint.every=0", "logging.logger=[jsonl]",
                 "logging.plot=false"]) == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl_lines = [m for m in lines if "rollout/samples" in m and "batch/samples" in m]
    assert len(rl_lines) == len(produced) == len(batches) == 3
    for m, experiences, batch in zip(rl_lines, produced, batches):
        scores = [e.score for e in experiences]
        assert m["rollout/samples"] == len(scores) == 12.0
        assert m["rollout/reward"] == pytest.approx(sum(scores) / len(scores))
        assert m["rollout/accuracy"] == pytest.approx(sum(s >= 1 for s in scores) / len(scores))
        assert m["batch/samples"] == batch["scores"].numel() == m["buffer/sampled"]
        assert m["batch/groups"] == batch["group_ids"].unique().numel()
        assert m["reward"] == pytest.approx(batch["scores"].double().mean().item())
        assert m["rollout/samples"] - m["batch/samples"] == 3 * m["buffer/groups_dropped"]
    # the run did filter: on some step the trained batch is smaller and its mean reward another number
    assert any(m["batch/samples"] < m["rollout/samples"] and m["reward"] != pytest.approx(m["rollout/reward"])
               for m in rl_lines)
