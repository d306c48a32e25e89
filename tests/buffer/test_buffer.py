import pytest

from rltk.batch import Experience
from rltk.buffer.buffer import BufferItem, ExperienceBuffer


def exp(tag: int, group: int = 0, score: float = 0.0) -> Experience:
    # prompt_ids carries a tag so tests can tell experiences apart at a glance
    return Experience(prompt_ids=[tag], response_ids=[1], score=score, group_id=group)


def tags(items):
    return [(i.experience if isinstance(i, BufferItem) else i).prompt_ids[0] for i in items]


def test_put_keeps_order_step_and_source():
    buffer = ExperienceBuffer()
    buffer.put([exp(1), exp(2)], step=3)
    buffer.put([exp(3)], step=4, source="expert")
    assert len(buffer) == 3
    assert [(i.step, i.source) for i in buffer.items()] == [(3, "policy"), (3, "policy"), (4, "expert")]
    assert tags(buffer.items("expert")) == [3]
    assert buffer.latest_step() == 4 and buffer.latest_step("policy") == 3 and buffer.latest_step("x") is None
    buffer.items().clear()  # a copy
    assert len(buffer) == 3


def test_pop_take_drop_and_clear():
    buffer = ExperienceBuffer()
    for step in range(1, 5):
        buffer.put([exp(10 * step), exp(10 * step + 1)], step=step)
    buffer.put([exp(99)], step=2, source="expert")
    assert tags(buffer.pop(3)) == [10, 11, 20]
    assert tags(buffer.pop(1, source="expert")) == [99]
    assert buffer.drop_older_than(3) == 1  # 21
    assert tags(buffer.take(lambda i: i.experience.prompt_ids[0] % 2 == 1)) == [31, 41]
    assert buffer.drop(lambda i: i.step == 4) == 1
    assert tags(buffer.items()) == [30]
    assert buffer.pop(0) == [] and tags(buffer.pop()) == [30]
    buffer.put([exp(5)], step=9)
    assert buffer.clear() == 1 and len(buffer) == 0


def test_capacity_evicts_oldest_and_counts():
    buffer = ExperienceBuffer(capacity=3)
    buffer.put([exp(1), exp(2)], step=1)
    buffer.put([exp(3), exp(4)], step=2)
    assert tags(buffer.items()) == [2, 3, 4] and buffer.evicted == 1
    buffer.put([exp(5), exp(6), exp(7), exp(8)], step=3)
    assert tags(buffer.items()) == [6, 7, 8] and buffer.evicted == 5


def test_errors():
    buffer = ExperienceBuffer()
    with pytest.raises(TypeError, match="item 1 is a dict, not a rltk.batch.Experience"):
        buffer.put([exp(1), {"score": 1}], step=0)
    assert len(buffer) == 0  # nothing from a rejected put
    with pytest.raises(TypeError, match="step must be an integer"):
        buffer.put([exp(1)], step="3")
    with pytest.raises(TypeError, match="source must be a non-empty string"):
        buffer.put([exp(1)], step=1, source="")
    with pytest.raises(ValueError, match="capacity must be an integer >= 1"):
        ExperienceBuffer(capacity=0)
    with pytest.raises(ValueError, match="count must be an integer >= 0"):
        buffer.pop(-1)
