import rltk
from rltk.rewards.countdown import countdown
from rltk.rewards.format import format_tags
from rltk.rewards.math import exact_match, math_answer


def test_builtin_reward_functions_are_registered():
    expected = {"exact_match": exact_match, "math_answer": math_answer, "countdown": countdown,
                "format_tags": format_tags}
    for name, fn in expected.items():
        assert rltk.get_component("reward_fn", name) is fn
    entries = {e.name: e for e in rltk.list_components("reward_fn")}
    assert set(expected) <= set(entries)
    assert entries["countdown"].plugin == "rltk:rewards"
    assert entries["math_answer"].summary.startswith("1.0 when the response's final answer")


def test_every_builtin_follows_the_calling_convention():
    sample = {"prompt": "p", "response": "<answer>1+2</answer>", "ground_truth": "3",
              "extras": {"numbers": [1, 2]}}
    for entry in rltk.list_components("reward_fn"):
        if entry.plugin != "rltk:rewards" or entry.name == "code_execution":
            continue  # code_execution takes JSON tests and returns a dict: tests/rewards/test_code_execution.py
        assert isinstance(entry.obj(**sample), float), entry.name
