import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.batch import Experience
from rltk.buffer.buffer import ExperienceBuffer
from rltk.buffer.strategies import FilterEqualGroups, MixExpert, OnPolicy, Staleness


def exp(tag: int, group: int, score: float = 0.0) -> Experience:
    return Experience(prompt_ids=[tag], response_ids=[1], score=score, group_id=group)


def group(first_tag: int, group_id: int, scores) -> list[Experience]:
    return [exp(first_tag + i, group_id, s) for i, s in enumerate(scores)]


def tags(experiences):
    return [getattr(e, "experience", e).prompt_ids[0] for e in experiences]  # Experience or BufferItem


def test_registered_names():
    assert rltk.get_component("sample_strategy", "on_policy") is OnPolicy
    assert rltk.get_component("sample_strategy", "filter_equal_groups") is FilterEqualGroups
    assert rltk.get_component("sample_strategy", "staleness") is Staleness
    assert rltk.get_component("sample_strategy", "mix_expert") is MixExpert


# ----------------------------------------------------------------------------- on_policy


def test_on_policy_takes_the_latest_step_once_and_empties_the_buffer():
    buffer, strategy = ExperienceBuffer(), OnPolicy()
    buffer.put(group(10, 0, [1, 0]), step=1)  # never sampled: stale by step 2
    buffer.put(group(20, 1, [1, 1]), step=2)
    buffer.put(group(30, 2, [0, 1]), step=2)  # a second rollout round of the same step
    assert tags(strategy.sample(buffer, 2)) == [20, 21, 30, 31]
    assert len(buffer) == 0
    assert strategy.metrics() == {"buffer/sampled": 4.0, "buffer/dropped_stale": 2.0, "buffer/staleness": 0.0}
    with pytest.raises(ValueError, match="buffer is empty at step 3; put the step's experiences in"):
        strategy.sample(buffer, 3)


# ----------------------------------------------------------------------------- filter_equal_groups


def test_filter_equal_groups_drops_groups_without_signal():
    buffer, strategy = ExperienceBuffer(), FilterEqualGroups()
    buffer.put(group(0, 0, [1, 1, 1]) + group(10, 1, [0, 1, 0]) + group(20, 2, [0, 0, 0])
               + group(30, 3, [0.5, 0.5, 0.5 + 1e-9]) + group(40, 4, [1, 0, 0]) + group(50, 5, [7]), step=1)
    assert tags(strategy.sample(buffer, 1)) == [10, 11, 12, 40, 41, 42]
    assert strategy.metrics() == {
        "buffer/sampled": 6.0, "buffer/dropped_stale": 0.0, "buffer/staleness": 0.0, "buffer/groups": 6.0,
        "buffer/groups_equal": 4.0, "buffer/groups_dropped": 4.0, "buffer/groups_kept_equal": 0.0,
    }
    assert len(buffer) == 0


def test_filter_equal_groups_keeps_a_minimum():
    buffer, strategy = ExperienceBuffer(), FilterEqualGroups(min_groups=3)
    buffer.put(group(0, 0, [1, 1]) + group(10, 1, [0, 1]) + group(20, 2, [0, 0]) + group(30, 3, [1, 1]), step=1)
    # one informative group; the two earliest equal groups top it up to three, in buffer order
    assert tags(strategy.sample(buffer, 1)) == [0, 1, 10, 11, 20, 21]
    assert strategy.metrics()["buffer/groups_kept_equal"] == 2.0
    assert strategy.metrics()["buffer/groups_dropped"] == 1.0
    strict = FilterEqualGroups(min_groups=0)
    buffer.put(group(0, 7, [1, 1]), step=2)
    assert strict.sample(buffer, 2) == []


def test_filter_equal_groups_arguments():
    with pytest.raises(ValueError, match=r"'filter_equal_groups': min_groups \(buffer.sample_strategy_args.min_groups\) must be an integer >= 0, got -1"):
        FilterEqualGroups(min_groups=-1)
    with pytest.raises(ValueError, match=r"atol \(buffer.sample_strategy_args.atol\) must be a number >= 0"):
        FilterEqualGroups(atol=-0.1)


# ----------------------------------------------------------------------------- staleness


def test_staleness_fifo_whole_groups_within_the_bound():
    buffer, strategy = ExperienceBuffer(), Staleness(max_staleness=1, batch_size=5)
    buffer.put(group(10, 0, [0, 1]), step=1)
    buffer.put(group(20, 1, [0, 1]) + group(30, 2, [1, 1]), step=2)
    buffer.put(group(40, 3, [0, 0, 1]), step=3)
    # at step 3, step-1 experiences are 2 steps old: dropped; then FIFO, whole groups, at most 5
    assert tags(strategy.sample(buffer, 3)) == [20, 21, 30, 31]
    assert strategy.metrics() == {"buffer/sampled": 4.0, "buffer/dropped_stale": 2.0,
                                  "buffer/staleness_mean": 1.0, "buffer/staleness_max": 1.0,
                                  "buffer/remaining": 3.0}
    assert tags(strategy.sample(buffer, 3)) == [40, 41, 42]
    assert strategy.sample(buffer, 3) == [] and strategy.metrics()["buffer/sampled"] == 0.0


def test_staleness_zero_and_unbounded_batch_and_oversized_group():
    buffer = ExperienceBuffer()
    buffer.put(group(10, 0, [0, 1]), step=4)
    buffer.put(group(20, 1, [0, 1, 1]), step=5)
    assert tags(Staleness(max_staleness=0).sample(buffer, 5)) == [20, 21, 22]
    buffer.put(group(30, 2, [0, 1, 1]), step=6)
    # a group larger than batch_size still comes out whole rather than never
    assert tags(Staleness(max_staleness=0, batch_size=2).sample(buffer, 6)) == [30, 31, 32]


def test_staleness_arguments():
    with pytest.raises(ValueError, match=r"'staleness': max_staleness \(buffer.sample_strategy_args.max_staleness\) must be an integer >= 0"):
        Staleness(max_staleness=-1)
    with pytest.raises(ValueError, match=r"batch_size\) must be an integer >= 1 or null, got 0"):
        Staleness(batch_size=0)


# ----------------------------------------------------------------------------- mix_expert


def test_mix_expert_adds_the_configured_share_and_recycles():
    buffer, strategy = ExperienceBuffer(), MixExpert(expert_fraction=0.25)
    buffer.put([exp(100 + i, 1000 + i, 1.0) for i in range(3)], step=0, source="expert")
    buffer.put(group(10, 0, [0, 1, 0]) + group(20, 1, [1, 1, 0]), step=1)
    # 6 policy experiences; 0.25 of the batch expert -> round(0.25 * 6 / 0.75) = 2
    assert tags(strategy.sample(buffer, 1)) == [10, 11, 12, 20, 21, 22, 100, 101]
    assert strategy.metrics() == {"buffer/sampled": 8.0, "buffer/policy": 6.0, "buffer/expert": 2.0,
                                  "buffer/expert_fraction": 0.25, "buffer/expert_shortfall": 0.0,
                                  "buffer/expert_joined": 0.0, "buffer/dropped_stale": 0.0}
    # used demonstrations go to the back of the queue
    assert tags(buffer.items("expert")) == [102, 100, 101]
    buffer.put(group(30, 2, [0, 1, 0]) + group(40, 3, [1, 1, 0]), step=2)
    assert tags(strategy.sample(buffer, 2))[-2:] == [102, 100]


def test_mix_expert_without_recycling_runs_dry():
    buffer, strategy = ExperienceBuffer(), MixExpert(expert_fraction=0.5, recycle_expert=False)
    buffer.put([exp(100, 1000), exp(101, 1001), exp(102, 1002)], step=0, source="expert")
    buffer.put(group(10, 0, [0, 1]), step=1)
    assert tags(strategy.sample(buffer, 1)) == [10, 11, 100, 101]
    buffer.put(group(20, 1, [0, 1]), step=2)
    assert tags(strategy.sample(buffer, 2)) == [20, 21, 102]
    assert strategy.metrics()["buffer/expert_shortfall"] == 1.0
    buffer.put(group(30, 2, [0, 1]), step=3)
    assert tags(strategy.sample(buffer, 3)) == [30, 31]  # dry now: on-policy only, and said so
    assert strategy.metrics()["buffer/expert_shortfall"] == 2.0


def test_mix_expert_puts_a_demonstration_for_a_prompt_of_the_step_in_that_prompts_group():
    buffer, strategy = ExperienceBuffer(), MixExpert(expert_fraction=0.25)
    # two demonstrations for other prompts queue before the one for prompt 20
    buffer.put([exp(100, -1, 1.0), exp(101, -2, 1.0), exp(20, -3, 1.0)], step=0, source="expert")
    policy = [exp(10, 0), exp(10, 0, 1.0), exp(20, 1), exp(20, 1)]
    for e in policy:
        e.baseline_score = float(e.group_id) / 2  # a ReMax baseline per prompt
    buffer.put(policy, step=1)
    # round(0.25 * 4 / 0.75) = 1 expert experience: the one whose prompt the step sampled, in group 1
    chosen = strategy.sample(buffer, 1)
    assert [(e.prompt_ids[0], e.group_id) for e in chosen] == [(10, 0), (10, 0), (20, 1), (20, 1), (20, 1)]
    assert chosen[-1].baseline_score == 0.5 and chosen[-1].score == 1.0  # the group's baseline, its own score
    assert strategy.metrics()["buffer/expert_joined"] == 1.0
    # the stored demonstration keeps its own group id for later steps (recycled to the back)
    assert [(item.experience.prompt_ids[0], item.experience.group_id) for item in buffer.items("expert")] == [
        (100, -1), (101, -2), (20, -3)]
    # with no matching prompt the queue order decides and the group stays its own
    buffer.put([exp(30, 2), exp(30, 2, 1.0), exp(40, 3), exp(40, 3)], step=2)
    assert [(e.prompt_ids[0], e.group_id) for e in strategy.sample(buffer, 2)][-1] == (100, -1)
    assert strategy.metrics()["buffer/expert_joined"] == 0.0


def test_mix_expert_errors():
    buffer = ExperienceBuffer()
    buffer.put(group(10, 0, [0, 1]), step=1)
    with pytest.raises(ValueError, match="no experiences of source 'expert'"):
        MixExpert().sample(buffer, 1)
    with pytest.raises(ValueError, match="no policy experiences in the buffer at step 2"):
        MixExpert().sample(ExperienceBuffer(), 2)
    assert tags(MixExpert(expert_fraction=0.0).sample(buffer, 1)) == [10, 11]  # the failed call took nothing
    with pytest.raises(ValueError, match=r"expert_fraction\) must be a number in \[0, 1\), got 1.0"):
        MixExpert(expert_fraction=1.0)
    with pytest.raises(ValueError, match="other than 'policy'"):
        MixExpert(expert_source="policy")


# ----------------------------------------------------------------------------- properties

group_sizes = st.lists(st.integers(1, 4), min_size=1, max_size=6)
score_lists = st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=8, max_size=8)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(sizes=group_sizes, scores=score_lists, min_groups=st.integers(0, 4))
def test_filter_equal_groups_properties(sizes, scores, min_groups):
    buffer, experiences = ExperienceBuffer(), []
    for gid, size in enumerate(sizes):
        experiences += [exp(10 * gid + i, gid, scores[(gid + i) % 8]) for i in range(size)]
    buffer.put(experiences, step=1)
    chosen = FilterEqualGroups(min_groups=min_groups).sample(buffer, 1)
    kept = {e.group_id for e in chosen}
    informative = {gid for gid in range(len(sizes)) if len({e.score for e in experiences if e.group_id == gid}) > 1}
    assert informative <= kept  # every group with signal survives
    assert len(kept) == max(len(informative), min(min_groups, len(sizes)))
    for gid in kept:  # groups are whole
        assert sum(e.group_id == gid for e in chosen) == sizes[gid]
    assert tags(chosen) == [t for t in tags(experiences) if t // 10 in kept]  # order preserved
    assert len(buffer) == 0


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(plan=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3)), min_size=1, max_size=8),
       max_staleness=st.integers(0, 2), batch_size=st.one_of(st.none(), st.integers(1, 6)))
def test_staleness_properties(plan, max_staleness, batch_size):
    """Each step puts `groups x size` experiences and samples once; nothing is lost or served twice."""
    buffer, strategy = ExperienceBuffer(), Staleness(max_staleness, batch_size)
    served, dropped, put, gid = [], 0, 0, 0
    for step, (groups, size) in enumerate(plan, start=1):
        for _ in range(groups):
            buffer.put([exp(1000 * gid + i, gid) for i in range(size)], step=step)
            gid, put = gid + 1, put + size
        batch = strategy.sample(buffer, step)
        m = strategy.metrics()
        dropped += m["buffer/dropped_stale"]
        assert m["buffer/staleness_max"] <= max_staleness
        if batch_size is not None and len({e.group_id for e in batch}) > 1:
            assert len(batch) <= batch_size
        served += batch
    assert len(set(tags(served))) == len(served)  # never twice
    assert len(served) + dropped + len(buffer) == put  # never lost
    for g in {e.group_id for e in served}:  # never split
        assert sum(e.group_id == g for e in served) == plan_size(plan, g)


def plan_size(plan, group_id):
    seen = 0
    for groups, size in plan:
        if group_id < seen + groups:
            return size
        seen += groups
    raise AssertionError(group_id)
