"""How an RL step gathers its experiences: DAPO's dynamic-sampling refill, ReMax's greedy baseline,
and expert experiences from a dataset."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.batch import Experience
from rltk.config import load_config
from rltk.data.sampler import RowSampler
from rltk.errors import ConfigError
from rltk.training.rollouts.collect import RolloutPlan, collect_experiences, expert_experiences, scores_differ


class ScriptedWorkflow:
    """Gives row ``r`` a group of two experiences scored ``scores[r]``; records each call."""

    def __init__(self, scores: dict[str, tuple[float, float]]):
        self.scores, self.calls = scores, []
        self._next_group = 0

    def run(self, rows, **kwargs):
        self.calls.append(([r["id"] for r in rows], kwargs))
        out = []
        for row in rows:
            for s in self.scores[row["id"]]:
                out.append(Experience(prompt_ids=[1], response_ids=[2], score=s, group_id=self._next_group,
                                      info={"row": row["id"]}))
            self._next_group += 1
        return out


def rows(n):
    return [{"prompt": f"p{i}", "id": f"r{i}"} for i in range(n)]


def informative(*ids):
    return {f"r{i}": ((0.0, 1.0) if i in ids else (1.0, 1.0)) for i in range(12)}


def test_without_dynamic_sampling_one_round_and_only_what_was_produced():
    workflow = ScriptedWorkflow(informative(1))
    sampler = RowSampler(rows(12), 3, shuffle=False)
    experiences, metrics = collect_experiences(workflow, sampler, RolloutPlan())
    assert [e.info["row"] for e in experiences] == ["r0", "r0", "r1", "r1", "r2", "r2"]  # equal groups kept
    # scores 1 1 | 0 1 | 1 1: five of six solved
    assert metrics == {"rollout/reward": 5 / 6, "rollout/accuracy": 5 / 6, "rollout/samples": 6.0,
                       "rollout/groups": 3.0}
    assert workflow.calls == [(["r0", "r1", "r2"], {})]


def test_dynamic_sampling_refills_until_the_batch_holds_as_many_informative_groups_as_prompts():
    # rounds draw r0-r2, r3-r5, r6-r8: informative are r1, r4, r6, r7 -> the first three are kept,
    # r7 is surplus, and five all-equal groups are dropped
    workflow = ScriptedWorkflow(informative(1, 4, 6, 7))
    sampler = RowSampler(rows(12), 3, shuffle=False)
    experiences, metrics = collect_experiences(workflow, sampler, RolloutPlan(dynamic_sampling=True, max_rounds=8))
    assert [e.info["row"] for e in experiences] == ["r1", "r1", "r4", "r4", "r6", "r6"]
    assert metrics == {"dynamic_sampling/rounds": 3.0, "dynamic_sampling/cap_reached": 0.0,
                       "dynamic_sampling/groups": 3.0, "dynamic_sampling/groups_target": 3.0,
                       "dynamic_sampling/groups_dropped": 5.0, "dynamic_sampling/groups_surplus": 1.0,
                       "dynamic_sampling/generated_tokens": 18.0,  # 9 groups of 2 one-token responses
                       # every round's 18 responses: 4 informative groups score 0 and 1, 5 equal ones 1 and 1
                       "rollout/reward": 14 / 18, "rollout/accuracy": 14 / 18, "rollout/samples": 18.0,
                       "rollout/groups": 9.0}
    assert [c[0] for c in workflow.calls] == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6", "r7", "r8"]]
    assert sampler.next_batch()[0]["id"] == "r9"  # the sampler moved on by exactly the rounds drawn


def test_dynamic_sampling_stops_at_the_round_cap_and_says_so():
    workflow = ScriptedWorkflow(informative(4))
    sampler = RowSampler(rows(12), 3, shuffle=False)
    experiences, metrics = collect_experiences(workflow, sampler, RolloutPlan(dynamic_sampling=True, max_rounds=2))
    assert [e.info["row"] for e in experiences] == ["r4", "r4"]
    assert metrics["dynamic_sampling/rounds"] == 2.0 and metrics["dynamic_sampling/cap_reached"] == 1.0
    assert metrics["dynamic_sampling/groups"] == 1.0 and metrics["dynamic_sampling/groups_dropped"] == 5.0
    # nothing informative within the cap: an empty batch (the recipes skip the step)
    workflow = ScriptedWorkflow(informative())
    experiences, metrics = collect_experiences(workflow, RowSampler(rows(12), 3, shuffle=False),
                                               RolloutPlan(dynamic_sampling=True, max_rounds=1))
    assert experiences == [] and metrics["dynamic_sampling/cap_reached"] == 1.0


def test_the_greedy_baseline_is_asked_for_in_every_round():
    workflow = ScriptedWorkflow(informative(3))
    plan = RolloutPlan(greedy_baseline=True, dynamic_sampling=True, max_rounds=4)
    collect_experiences(workflow, RowSampler(rows(12), 2, shuffle=False), plan)
    assert [c[1] for c in workflow.calls] == [{"greedy_baseline": True}] * 4


class FakeStrategy:
    """Two ranks in one process: ``others_short`` is what the other rank reports each round."""

    world_size = data_world_size = 2

    def __init__(self, rank, others_short):
        self.rank = self.data_rank = rank
        self.others_short = list(others_short)

    def all_reduce_sum(self, tensor):
        if tensor.numel() == 1:  # the "does any rank still need groups" vote
            return tensor + float(self.others_short.pop(0))
        return tensor * 2  # the counts: the other rank reports the same as this one


def test_a_full_rank_keeps_drawing_while_another_rank_needs_groups():
    # this rank (0 of 2) is full after round 1; the other still needs groups in rounds 1 and 2
    workflow = ScriptedWorkflow(informative(0, 2, 4, 6, 8, 10))
    sampler = RowSampler(rows(12), 4, shuffle=False)
    experiences, metrics = collect_experiences(workflow, sampler, RolloutPlan(dynamic_sampling=True, max_rounds=8),
                                               FakeStrategy(0, [True, True, False]))
    assert [c[0] for c in workflow.calls] == [["r0", "r2"]]  # generated once, its share of the first batch
    assert metrics["dynamic_sampling/rounds"] == 3.0 and metrics["dynamic_sampling/groups"] == 4.0
    assert metrics["dynamic_sampling/generated_tokens"] == 8.0  # one round of 2 groups, doubled for the other rank
    assert sampler.next_batch()[0]["id"] == "r0"  # drew three batches of 4 from 12 rows: a new epoch


@settings(max_examples=50, deadline=None, derandomize=True, database=None)
@given(flags=st.lists(st.booleans(), min_size=12, max_size=12), per_round=st.integers(1, 4),
       max_rounds=st.integers(1, 5))
def test_dynamic_sampling_invariants(flags, per_round, max_rounds):
    workflow = ScriptedWorkflow({f"r{i}": ((0.0, 1.0) if f else (0.5, 0.5)) for i, f in enumerate(flags)})
    sampler = RowSampler(rows(12), per_round, shuffle=False)
    experiences, m = collect_experiences(workflow, sampler, RolloutPlan(dynamic_sampling=True, max_rounds=max_rounds))
    groups = {}
    for e in experiences:
        groups.setdefault(e.group_id, []).append(e)
    assert all(scores_differ(g) for g in groups.values())  # never an all-equal group
    assert len(groups) == m["dynamic_sampling/groups"] <= per_round  # never more than a step's prompts
    assert m["dynamic_sampling/cap_reached"] == float(len(groups) < per_round)
    assert m["dynamic_sampling/rounds"] == len(workflow.calls) <= max_rounds
    # every generated group is either kept, dropped or surplus
    assert len(workflow.calls) * per_round == (m["dynamic_sampling/groups"] + m["dynamic_sampling/groups_dropped"]
                                               + m["dynamic_sampling/groups_surplus"])


def test_scores_differ():
    def group(*scores):
        return [Experience([1], [2], s, 0) for s in scores]

    assert scores_differ(group(0.0, 1.0)) and not scores_differ(group(1.0, 1.0))
    assert not scores_differ(group(1.0)) and not scores_differ(group(0.5, 0.5 + 1e-7))


def test_the_plan_follows_the_config_and_the_estimator():
    import rltk

    cfg = load_config([], ["algorithm.name=dapo"])
    plan = RolloutPlan.from_config(cfg)
    assert plan == RolloutPlan(greedy_baseline=False, dynamic_sampling=True, max_rounds=8)
    cfg = load_config([], ["algorithm.name=remax", "algorithm.dynamic_sampling_max_rounds=3"])
    plan = RolloutPlan.from_config(cfg)
    assert plan == RolloutPlan(greedy_baseline=True, dynamic_sampling=False, max_rounds=1)
    # the old form, an estimator beside the config, plans for that estimator for one more release
    with pytest.warns(DeprecationWarning, match="RolloutPlan.from_config"):
        old = RolloutPlan.from_config(load_config([], ["algorithm.name=dapo"]), rltk.get_component("advantage_fn", "remax"))
    assert old == RolloutPlan(greedy_baseline=True, dynamic_sampling=True, max_rounds=8)


# ----------------------------------------------------------------------------- expert data

class CharTokenizer:
    eos_token_id = 0
    bos_token_id = None
    chat_template = None

    def __call__(self, texts, add_special_tokens=False):
        if isinstance(texts, str):
            return {"input_ids": [ord(c) for c in texts]}
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def reward(prompt, response, ground_truth, extras):
    return float(response == ground_truth), {"exact": float(response == ground_truth)}


def expert_cfg(path, *overrides):
    cfg = load_config([], ["buffer.sample_strategy=mix_expert", f"buffer.expert.path={path}", *overrides],
                      validate=False)
    cfg.data.prompt_template = "Q: {prompt}"
    return cfg


def test_expert_rows_become_scored_experiences_with_the_training_prompt_format(tmp_path):
    path = tmp_path / "expert.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "1+2=", "response": "3", "answer": "3"},
        {"prompt": "2+2=", "response": "5", "answer": "4"},
    ]))
    experiences = expert_experiences(expert_cfg(path), CharTokenizer(), reward)
    assert [e.prompt_ids for e in experiences] == [[ord(c) for c in "Q: 1+2="], [ord(c) for c in "Q: 2+2="]]
    assert [e.response_ids for e in experiences] == [[ord("3"), 0], [ord("5"), 0]]  # + eos
    assert [e.score for e in experiences] == [1.0, 0.0]  # scored by the run's reward
    assert [e.group_id for e in experiences] == [-1, -2]  # ids no workflow hands out
    assert experiences[0].reward_details == {"exact": 1.0} and experiences[0].info["expert"] is True
    # a fixed score instead, and no answer column needed then
    path.write_text(json.dumps({"question": "1+2=", "solution": "3"}) + "\n")
    fixed = expert_experiences(expert_cfg(path, "buffer.expert.score=0.5", "buffer.expert.answer_key=null",
                                          "buffer.expert.prompt_key=question", "buffer.expert.response_key=solution"),
                               CharTokenizer(), reward)
    assert [(e.score, e.response_ids) for e in fixed] == [(0.5, [ord("3"), 0])]
    # one column as both the response and the answer it is scored against
    path.write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
    same = expert_experiences(expert_cfg(path, "buffer.expert.response_key=answer"), CharTokenizer(), reward)
    assert [(e.score, e.response_ids) for e in same] == [(1.0, [ord("3"), 0])]
    assert expert_experiences(load_config([], validate=False), CharTokenizer(), reward) == []


def test_expert_file_problems_name_the_key(tmp_path):
    path = tmp_path / "expert.jsonl"
    path.write_text(json.dumps({"prompt": "1+2=", "answer": "3", "text": "3"}) + "\n")
    with pytest.raises(ConfigError, match=r"buffer.expert.response_key='response' is not a column .*'text'"):
        expert_experiences(expert_cfg(path), CharTokenizer(), reward)
    with pytest.raises(ConfigError, match=r"buffer.expert.prompt_key='question' is not a column"):
        expert_experiences(expert_cfg(path, "buffer.expert.prompt_key=question"), CharTokenizer(), reward)
    with pytest.raises(ConfigError, match=r"buffer.expert.answer_key='solution' is not a column"):
        expert_experiences(expert_cfg(path, "buffer.expert.answer_key=solution"), CharTokenizer(), reward)


def test_collated_baselines_reach_the_remax_estimator():
    from rltk.algorithms.advantages import remax
    from rltk.batch import collate

    batch = collate([Experience([5], [6, 7], 1.0, 0, baseline_score=0.0),
                     Experience([5], [6], 0.0, 0, baseline_score=0.0),
                     Experience([8], [9], 1.0, 1, baseline_score=1.0)], pad_token_id=0)
    advantages, _ = remax(token_rewards=batch["token_rewards"], response_mask=batch["response_mask"],
                          baseline_scores=batch["baseline_scores"])
    assert torch.equal(advantages, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
