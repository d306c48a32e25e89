import torch
from hypothesis import given, settings, strategies as st

import rltk
from rltk_plugin_example import group_rank_advantages, overlong_penalty


def test_registered_through_entry_point():
    assert rltk.get_component("advantage_fn", "group_rank") is group_rank_advantages
    assert rltk.get_component("reward_fn", "overlong_penalty") is overlong_penalty
    plugins = {e.name: e.plugin for e in rltk.list_components("advantage_fn")}
    assert plugins["group_rank"] == "rltk-plugin-example:example"


def test_group_rank_hand_computed():
    # group 7: scores 0, 1, 1, 3 -> ranks 0, 1.5, 1.5, 3 -> centred / 1.5 -> -1, 0, 0, 1
    # group 2: a single response -> 0;  group 5: all equal -> 0
    scores = torch.tensor([1.0, 0.0, 5.0, 3.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([7, 7, 2, 7, 7, 5, 5])
    mask = torch.ones(7, 3)
    mask[0, 2] = 0
    adv, ret = group_rank_advantages(scores=scores, group_ids=groups, response_mask=mask)
    expected = torch.tensor([0.0, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv[:, 0], expected)
    assert adv[0, 2] == 0 and torch.equal(adv, ret)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-5, 5)), min_size=1, max_size=24))
def test_group_rank_properties(rows):
    groups = torch.tensor([g for g, _ in rows])
    scores = torch.tensor([float(s) for _, s in rows])
    adv, _ = group_rank_advantages(scores=scores, group_ids=groups, response_mask=torch.ones(len(rows), 1))
    adv = adv[:, 0]
    assert adv.abs().max() <= 1 + 1e-6
    for g in groups.unique():
        members = groups == g
        assert abs(adv[members].sum().item()) < 1e-5  # centred within each group
        # order-preserving: a higher score never gets a lower advantage
        s, a = scores[members], adv[members]
        assert ((s[:, None] > s[None, :]) <= (a[:, None] >= a[None, :])).all()


def test_overlong_penalty_dapo_shape():
    kw = dict(max_length=10, buffer_length=4)
    assert overlong_penalty(response="x" * 6, **kw) == 0.0
    assert overlong_penalty(response="x" * 8, **kw) == -0.5
    assert overlong_penalty(response="x" * 10, **kw) == -1.0
    assert overlong_penalty(response="x" * 11, **kw) == -1.0
    assert overlong_penalty(response="a b c d e f g h", unit="words", max_length=8, buffer_length=4) == -1.0
