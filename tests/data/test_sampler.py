from hypothesis import given, settings, strategies as st

import pytest

from rltk.data.sampler import RowSampler


@settings(max_examples=40, deadline=None)
@given(n_rows=st.integers(1, 30), batch=st.integers(1, 12), cut=st.integers(0, 10), seed=st.integers(0, 5))
def test_resume_continues_exactly_and_epochs_cover_every_row(n_rows, batch, cut, seed):
    rows = list(range(n_rows))
    straight = RowSampler(rows, batch, seed=seed)
    drawn = [straight.next_batch() for _ in range(12)]
    first = RowSampler(rows, batch, seed=seed)
    for _ in range(cut):
        first.next_batch()
    resumed = RowSampler(rows, batch, seed=seed)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.next_batch() for _ in range(12 - cut)] == drawn[cut:]
    flat = [r for b in drawn for r in b]
    for epoch in range(len(flat) // n_rows):
        assert sorted(flat[epoch * n_rows : (epoch + 1) * n_rows]) == rows


def test_no_shuffle_keeps_order_and_errors():
    assert RowSampler([1, 2, 3], 2, shuffle=False).next_batch() == [1, 2]
    with pytest.raises(ValueError, match="at least one row"):
        RowSampler([], 2)
    with pytest.raises(ValueError, match="batch_size"):
        RowSampler([1], 0)
