import math
import time

import pytest
import torch

import rltk
from rltk.batch import collate
from rltk.rollout.base import Completion, RolloutEngine, SamplingParams
from rltk.rollout.hf import HFRolloutEngine
from rltk.workflows.single_turn import SingleTurnWorkflow

from .conftest import build_model

from tests.waits import scaled

EOS = 1


class ScriptedEngine(RolloutEngine):
    """Answers each prompt with scripted texts (sample j gets script[prompt][j]), eos-terminated."""

    def __init__(self, tokenizer, script, truncate=()):
        self.tokenizer, self.script, self.truncate = tokenizer, script, set(truncate)
        self.calls = []

    def generate(self, prompt_ids, params):
        self.calls.append((prompt_ids, params))
        groups = []
        for index, ids in enumerate(prompt_ids):
            prompt = self.tokenizer.decode(ids)
            group = []
            for j in range(params.n):
                text = self.script[prompt][j % len(self.script[prompt])]
                tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                if (prompt, j) in self.truncate:
                    group.append(Completion(index, tokens, [-0.25] * len(tokens), "length"))
                else:
                    group.append(Completion(index, tokens + [EOS], [-0.25] * (len(tokens) + 1), "stop"))
            groups.append(group)
        return groups

    def update_weights(self, state_dict_or_model):
        pass


class ExactMatch:
    """A reward in the RewardComposer shape: (weighted total, details); records its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompt, response, ground_truth, extras=None):
        self.calls.append((prompt, response, ground_truth, extras))
        correct = float(response.strip() == ground_truth)
        short = float(len(response) <= extras.get("max_len", 99))
        return correct + 0.5 * short, {"exact": correct, "short": short}


ROWS = [
    {"prompt": "1+2=", "ground_truth": "3", "extras": {"max_len": 1}, "id": "a"},
    {"prompt": "2+2=", "ground_truth": "4", "extras": {}, "id": "b"},
]
SCRIPT = {"1+2=": ["3", "12", "3 "], "2+2=": ["4", "4", "22"]}


@pytest.fixture
def workflow(tokenizer):
    engine = ScriptedEngine(tokenizer, SCRIPT, truncate={("2+2=", 2)})
    return SingleTurnWorkflow(engine=engine, tokenizer=tokenizer, reward=ExactMatch(),
                              sampling=SamplingParams(n=3, temperature=0.9, max_new_tokens=5))


def test_registered_as_single_turn():
    assert rltk.get_component("workflow", "single_turn") is SingleTurnWorkflow


def test_run_builds_one_group_of_n_experiences_per_row(workflow, tokenizer, encode):
    experiences = workflow.run(ROWS)

    [(prompt_ids, params)] = workflow.engine.calls  # one engine call for the whole batch
    assert prompt_ids == [encode("1+2="), encode("2+2=")] and params is workflow.sampling
    assert [e.group_id for e in experiences] == [0, 0, 0, 1, 1, 1]
    assert [e.info["response"] for e in experiences] == ["3", "12", "3 ", "4", "4", "22"]  # eos not in the text
    assert [e.score for e in experiences] == [1.5, 0.0, 1.0, 1.5, 1.5, 0.5]
    assert [e.reward_details for e in experiences][:2] == [{"exact": 1.0, "short": 1.0},
                                                           {"exact": 0.0, "short": 0.0}]
    first, last = experiences[0], experiences[-1]
    assert first.prompt_ids == encode("1+2=") and first.response_ids == encode("3") + [EOS]
    assert first.rollout_logprobs == [-0.25, -0.25] and first.finish_reason == "stop"
    assert first.response_mask == [1, 1]
    assert last.response_ids == encode("22") and last.finish_reason == "length"
    assert first.info == {"prompt": "1+2=", "response": "3", "ground_truth": "3", "row_id": "a", "sample_index": 0}
    assert last.info["row_id"] == "b" and last.info["sample_index"] == 2
    assert workflow.reward.calls[0] == ("1+2=", "3", "3", {"max_len": 1})


def test_greedy_baseline_scores_one_greedy_response_per_row(tokenizer, encode):
    # the scripted engine answers greedily with a row's first script entry
    engine = ScriptedEngine(tokenizer, {"1+2=": ["12", "3"], "2+2=": ["4", "22"]})
    reward = ExactMatch()
    workflow = SingleTurnWorkflow(engine=engine, tokenizer=tokenizer, reward=reward,
                                  sampling=SamplingParams(n=2, temperature=0.9, max_new_tokens=5))
    experiences = workflow.run(ROWS, greedy_baseline=True)
    sampled, greedy = engine.calls
    assert sampled[1] is workflow.sampling
    assert greedy[0] == [encode("1+2="), encode("2+2=")] and greedy[1].greedy and greedy[1].n == 1
    assert greedy[1].max_new_tokens == 5
    # "12" for 1+2= scores 0 (wrong, longer than max_len 1); "4" for 2+2= scores 1 + 0.5
    assert [e.baseline_score for e in experiences] == [0.0, 0.0, 1.5, 1.5]
    assert [e.info["response"] for e in experiences] == ["12", "3", "4", "22"]  # the greedy one is not trained on
    assert workflow.metrics()["rollout/greedy_baseline_score"] == pytest.approx(0.75)
    assert len(reward.calls) == 6  # four samples and two greedy responses
    batch = collate(experiences, pad_token_id=0)
    assert batch["baseline_scores"].tolist() == [0.0, 0.0, 1.5, 1.5]
    # without it: one engine call, no baseline
    plain = workflow.run(ROWS)
    assert len(engine.calls) == 3 and all(e.baseline_score is None for e in plain)
    assert "rollout/greedy_baseline_score" not in workflow.metrics()
    assert "baseline_scores" not in collate(plain, pad_token_id=0)


def test_group_ids_are_never_reused_across_calls(workflow):
    workflow.run(ROWS)
    second = workflow.run(ROWS[::-1])
    assert [e.group_id for e in second] == [2, 2, 2, 3, 3, 3]
    assert workflow.run([]) == []


def test_metrics_describe_the_last_run(workflow):
    workflow.run(ROWS)
    metrics = workflow.metrics()
    # response lengths (tokens, eos included): 2, 3, 3, 2, 2, 2 (truncated "22" has no eos)
    assert metrics["rollout/response_length_mean"] == pytest.approx(14 / 6)
    assert metrics["rollout/response_length_max"] == 3.0
    assert metrics["rollout/generated_tokens"] == 14.0
    assert metrics["rollout/truncated_fraction"] == pytest.approx(1 / 6)
    assert metrics["reward/exact"] == pytest.approx(4 / 6)
    assert metrics["reward/short"] == pytest.approx(4 / 6)
    assert metrics["time/generate_s"] >= 0 and metrics["time/reward_s"] >= 0


def test_evaluate_is_greedy_and_counts_scores_at_least_one(workflow):
    result = workflow.evaluate(ROWS)
    [(_, params)] = workflow.engine.calls
    assert params.greedy and params.n == 1 and params.max_new_tokens == 5
    # greedy answers "3" (score 1.5) and "4" (score 1.5)
    assert result == {"accuracy": 1.0, "mean_score": 1.5, "mean_response_length": 2.0,
                      "truncated_fraction": 0.0, "num_responses": 2.0}
    # three samples per row with explicit params: scores 1.5, 0, 1, 1.5, 1.5, .5
    result = workflow.evaluate(ROWS, SamplingParams(n=3, greedy=True))
    assert result["accuracy"] == pytest.approx(4 / 6)
    assert result["mean_score"] == pytest.approx(1.0)
    assert workflow.evaluate(ROWS, SamplingParams(n=3, greedy=True), threshold=1.5)["accuracy"] == 0.5
    assert result["truncated_fraction"] == pytest.approx(1 / 6)
    with pytest.raises(ValueError, match="no rows"):
        workflow.evaluate([])


@pytest.mark.parametrize(
    "returned, score, details",
    [(0.25, 0.25, {}), ({"score": 2.0, "fmt": 1.0}, 2.0, {"score": 2.0, "fmt": 1.0}),
     ({"a": 1.0, "b": 0.5}, 1.5, {"a": 1.0, "b": 0.5}), ((1, {"x": 1}), 1.0, {"x": 1.0})],
)
def test_reward_may_return_a_float_a_dict_or_a_pair(tokenizer, returned, score, details):
    workflow = SingleTurnWorkflow(engine=ScriptedEngine(tokenizer, SCRIPT), tokenizer=tokenizer,
                                  reward=lambda **kw: returned, sampling=SamplingParams(n=1))
    [experience, _] = workflow.run(ROWS)
    assert experience.score == score and experience.reward_details == details


def test_reward_problems_name_the_row(tokenizer):
    def broken(**kw):
        raise ZeroDivisionError("oops")

    workflow = SingleTurnWorkflow(engine=ScriptedEngine(tokenizer, SCRIPT), tokenizer=tokenizer,
                                  reward=broken, sampling=SamplingParams(n=1))
    with pytest.raises(RuntimeError, match=r"reward raised on row 0 \(id 'a'\): ZeroDivisionError: oops"):
        workflow.run(ROWS)
    workflow.reward = lambda **kw: math.nan
    with pytest.raises(ValueError, match=r"score of nan for row 0 \(id 'a'\)"):
        workflow.run(ROWS)


def test_bad_rows_and_arguments(workflow, tokenizer):
    with pytest.raises(KeyError, match=r"row 1 \(id 'x'\) has no 'prompt' key; its keys are \['id', 'question'\]"):
        workflow.run([ROWS[0], {"question": "1+1=", "id": "x"}])
    with pytest.raises(TypeError, match="'extras' must be a dict"):
        workflow.run([{**ROWS[0], "extras": [1]}])
    with pytest.raises(ValueError, match="tokenizes to no tokens"):
        workflow.run([{**ROWS[0], "prompt": ""}])
    short = SingleTurnWorkflow(engine=workflow.engine, tokenizer=tokenizer, reward=ExactMatch(),
                               sampling=SamplingParams(), max_prompt_tokens=3)
    with pytest.raises(ValueError, match=r"row 0 \(id 'a'\) has a prompt of 4 tokens, more than max_prompt_tokens=3"):
        short.run(ROWS)
    with pytest.raises(TypeError, match="SamplingParams"):
        SingleTurnWorkflow(engine=workflow.engine, tokenizer=tokenizer, reward=ExactMatch(), sampling={"n": 2})
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        SingleTurnWorkflow(engine=workflow.engine, tokenizer=tokenizer, reward=ExactMatch(),
                           sampling=SamplingParams(), max_prompt_tokens=0)


class BatchRecorder(ExactMatch):
    """A reward with ``score_batch``: records how many calls a step makes, and their sizes."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def score_batch(self, samples):
        self.batches.append(len(samples))
        return [self(**sample) for sample in samples]


def test_a_step_scores_all_its_samples_in_one_reward_call(tokenizer):
    reward = BatchRecorder()
    workflow = SingleTurnWorkflow(engine=ScriptedEngine(tokenizer, SCRIPT), tokenizer=tokenizer, reward=reward,
                                  sampling=SamplingParams(n=3))
    experiences = workflow.run(ROWS)
    assert reward.batches == [6]
    assert [e.score for e in experiences] == [1.5, 0.0, 1.0, 1.5, 1.5, 0.5]  # each score on its own sample
    assert [c[1] for c in reward.calls] == ["3", "12", "3 ", "4", "4", "22"]
    workflow.evaluate(ROWS)
    assert reward.batches == [6, 2]


def test_hung_samples_of_a_step_cost_one_timeout(tokenizer):
    """Issue #12: hung reward calls were waited for one after another (2 hung samples: 2 timeouts)."""
    from rltk.rewards.compose import RewardComposer
    from tests.rewards import reward_fns as rf

    timeout = scaled(1.0)
    script = {"1+2=": ["3", "99", "3"], "2+2=": ["99", "4", "4"]}  # "99" hangs (the tokenizer knows digits)
    composer = RewardComposer([("hang", rf.sleep_if, 1.0, {"word": "99"}), ("exact", rf.correct, 1.0, {})],
                              timeout_s=timeout, workers=4)
    workflow = SingleTurnWorkflow(engine=ScriptedEngine(tokenizer, script), tokenizer=tokenizer, reward=composer,
                                  sampling=SamplingParams(n=3))
    try:
        composer(prompt="p", response="3", ground_truth="3")  # workers started and loaded
        start = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="RewardTimeout"):
            experiences = workflow.run(ROWS)
        elapsed = time.perf_counter() - start
    finally:
        composer.close()
    assert timeout <= elapsed < 1.7 * timeout  # one after another they took 2 timeouts
    assert [e.score for e in experiences] == [2.0, 0.0, 2.0, 0.0, 2.0, 2.0]
    assert composer.stats()["timeouts/hang"] == 2.0


def test_engine_breaking_its_contract_is_reported(tokenizer):
    class Short(ScriptedEngine):
        def generate(self, prompt_ids, params):
            return super().generate(prompt_ids, params)[:1]

    workflow = SingleTurnWorkflow(engine=Short(tokenizer, SCRIPT), tokenizer=tokenizer, reward=ExactMatch(),
                                  sampling=SamplingParams(n=3))
    with pytest.raises(RuntimeError, match=r"asked for 3 completions for each of 2 prompts, got group sizes \[3\]"):
        workflow.run(ROWS)


def test_with_the_hf_engine_end_to_end(tokenizer, encode):
    model = build_model(len(tokenizer))
    engine = HFRolloutEngine(model, tokenizer)
    workflow = SingleTurnWorkflow(engine=engine, tokenizer=tokenizer, reward=ExactMatch(),
                                  sampling=SamplingParams(n=4, max_new_tokens=6, seed=0))
    experiences = workflow.run(ROWS)
    assert len(experiences) == 8 and [e.group_id for e in experiences] == [0] * 4 + [1] * 4
    for e in experiences:
        assert len(e.rollout_logprobs) == len(e.response_ids) and all(lp <= 0 for lp in e.rollout_logprobs)
        assert e.info["response"] == tokenizer.decode(e.response_ids, skip_special_tokens=True)
        assert e.finish_reason == ("stop" if e.response_ids[-1] == EOS else "length")
    batch = collate(experiences, tokenizer.pad_token_id)
    lengths = [len(e.response_ids) for e in experiences]
    assert batch["response_mask"].sum(1).tolist() == lengths
    torch.testing.assert_close(batch["rollout_logprobs"].sum(1),
                               torch.tensor([sum(e.rollout_logprobs) for e in experiences], dtype=torch.float32))
