"""Workflow state across a checkpoint: group ids stay unique after a resume."""

from __future__ import annotations

import json

import pytest

from rltk.rollout.base import SamplingParams
from rltk.workflows.base import Workflow
from rltk.workflows.single_turn import SingleTurnWorkflow

from .test_single_turn import ROWS, SCRIPT, ExactMatch, ScriptedEngine


def single_turn(tokenizer) -> SingleTurnWorkflow:
    return SingleTurnWorkflow(engine=ScriptedEngine(tokenizer, SCRIPT), tokenizer=tokenizer, reward=ExactMatch(),
                              sampling=SamplingParams(n=2, max_new_tokens=5))


def test_a_resumed_workflow_numbers_groups_on_from_the_interrupted_one(tokenizer):
    first = single_turn(tokenizer)
    first.run(ROWS)
    first.run(ROWS)  # groups 0..3
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"next_group_id": 4}

    resumed = single_turn(tokenizer)
    resumed.load_state_dict(state)
    assert [e.group_id for e in resumed.run(ROWS)] == [4, 4, 5, 5] == [e.group_id for e in first.run(ROWS)]


@pytest.mark.parametrize("state, message", [
    ({}, r"expected \{'next_group_id': int\}.*got \[\]"),
    ({"next_group_id": 1, "x": 2}, r"got \['next_group_id', 'x'\]"),
    ({"next_group_id": -1}, r"state\['next_group_id'\] = -1 must be an integer >= 0"),
    ({"next_group_id": True}, r"state\['next_group_id'\] = True"),
    ([4], r"got list"),
])
def test_bad_state_is_refused_naming_the_entry(tokenizer, state, message):
    workflow = single_turn(tokenizer)
    with pytest.raises(ValueError, match=message):
        workflow.load_state_dict(state)
    assert workflow.state_dict() == {"next_group_id": 0}


class Stateless(Workflow):
    def run(self, rows):
        return []


def test_a_workflow_without_state_saves_none_and_refuses_some():
    workflow = Stateless()
    assert workflow.state_dict() == {}
    workflow.load_state_dict({})
    with pytest.raises(ValueError, match=r"Stateless.load_state_dict: this workflow keeps no state, got keys \['n'\]"):
        workflow.load_state_dict({"n": 1})
