import math

import pytest

from rltk.rollout.base import SamplingParams
from rltk.workflows.base import Workflow, check_rows, check_workflow_parts, held_out_metrics, normalize_reward_output


@pytest.mark.parametrize(
    "result, expected",
    [
        (1, (1.0, {})),
        (0.5, (0.5, {})),
        ((1.25, {"math": 1.0, "format": 0.5}), (1.25, {"math": 1.0, "format": 0.5})),
        ({"score": 3.0, "bonus": 1.0}, (3.0, {"score": 3.0, "bonus": 1.0})),
        ({"math": 1.0, "format": 0.25}, (1.25, {"math": 1.0, "format": 0.25})),
    ],
)
def test_normalize_reward_output(result, expected):
    assert normalize_reward_output(result, "row 0") == expected


@pytest.mark.parametrize("bad", [math.inf, math.nan, "1", None, True, (None, {})])
def test_normalize_reward_output_rejects_non_numbers(bad):
    with pytest.raises(ValueError, match="for row 7 \\(id 'q'\\); it must be a finite number"):
        normalize_reward_output(bad, "row 7 (id 'q')")


def test_check_rows():
    rows = [{"prompt": "a"}, {"prompt": "b", "extras": None}]
    assert check_rows(rows, "wf") == rows
    with pytest.raises(TypeError, match="list of row dicts, got dict"):
        check_rows({"prompt": "a"}, "wf")
    with pytest.raises(TypeError, match="row 1 must be a dict, got str"):
        check_rows([{"prompt": "a"}, "b"], "wf")
    with pytest.raises(TypeError, match="row 0 \\(id 'z'\\) 'prompt' must be text, got list"):
        check_rows([{"prompt": [1, 2], "id": "z"}], "wf")


def test_workflow_base_contract():
    with pytest.raises(TypeError):
        Workflow()

    class Nothing(Workflow):
        def run(self, rows):
            return []

    workflow = Nothing()
    assert workflow.run([]) == [] and workflow.metrics() == {}
    with pytest.raises(NotImplementedError, match="Nothing does not implement evaluate"):
        workflow.evaluate([{"prompt": "x"}])


def test_held_out_metrics_of_four_responses():
    # scores 1, 0.5, 0, 1 at threshold 1: two solved; lengths 3+5+2+6 = 16 tokens; one cut at its limit
    assert held_out_metrics([1.0, 0.5, 0.0, 1.0], [3, 5, 2, 6], 1, threshold=1.0) == {
        "accuracy": 0.5, "mean_score": 0.625, "mean_response_length": 4.0, "truncated_fraction": 0.25,
        "num_responses": 4.0}


def test_every_workflow_checks_its_parts_by_name():
    check_workflow_parts("mine", SamplingParams(), lambda **_: 1.0)
    with pytest.raises(TypeError, match="mine: sampling must be a rltk.rollout.base.SamplingParams, got dict"):
        check_workflow_parts("mine", {"n": 2}, lambda **_: 1.0)
    with pytest.raises(TypeError, match="mine: reward must be callable, got str"):
        check_workflow_parts("mine", SamplingParams(), "exact_match")
