import rltk
from rltk.rewards.judges.llm_judge import llm_judge
from rltk.rewards.judges.reward_model import reward_model
from rltk.rewards.marks import is_batched
from rltk.rewards.verifiable.choice import multiple_choice
from rltk.rewards.verifiable.countdown import countdown
from rltk.rewards.verifiable.format import format_tags
from rltk.rewards.verifiable.math import exact_match, math_answer


def test_builtin_reward_functions_are_registered():
    expected = {"exact_match": exact_match, "math_answer": math_answer, "countdown": countdown,
                "format_tags": format_tags, "multiple_choice": multiple_choice, "reward_model": reward_model, "llm_judge": llm_judge}
    for name, fn in expected.items():
        assert rltk.get_component("reward_fn", name) is fn
    entries = {e.name: e for e in rltk.list_components("reward_fn")}
    assert set(expected) <= set(entries)
    assert entries["countdown"].plugin == "rltk:rewards"
    assert entries["math_answer"].summary.startswith("1.0 when the response's final answer")


def test_every_builtin_follows_the_calling_convention():
    """Per-sample builtins take one sample and return a float; the batched ones (reward services, which need a
    model or a server: tested in test_reward_model.py and test_llm_judge.py) are marked and say so."""
    sample = {"prompt": "p", "response": "<answer>1+2</answer>", "ground_truth": "3",
              "extras": {"numbers": [1, 2]}}
    batched = set()
    for entry in rltk.list_components("reward_fn"):
        if entry.plugin != "rltk:rewards" or entry.name == "code_execution":
            continue  # code_execution takes JSON tests and returns a dict: tests/rewards/test_code_execution.py
        if is_batched(entry.obj):
            batched.add(entry.name)
            continue
        assert isinstance(entry.obj(**sample), float), entry.name
    assert batched == {"reward_model", "llm_judge"}
