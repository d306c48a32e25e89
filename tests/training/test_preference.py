"""The DPO recipe's mechanics: pairs from rows and from samples, pair batches, and one preference step."""

from __future__ import annotations

import math
import random

import pytest
import torch

import rltk

from rltk.batch import Experience
from rltk.data.preferences import near_miss, synthetic_preferences
from rltk.errors import ConfigError
from rltk.training.step.forward import ForwardSettings
from rltk.training.updates.preference import (
    PairExample, PreferenceLoss, online_pairs, pair_batch, pair_settings, preference_examples, preference_step,
    reference_sequence_logps,
)
from rltk.training.step.reference import FrozenReference
from tests.training.rl_step_helpers import one_process_strategy


class CharTokenizer:
    """ids = code points; eos 0."""

    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 50 + 1 for c in text]}


def test_near_miss_is_wrong_and_close():
    rng = random.Random(0)
    for answer in ["0", "7", "42", "105", "-3"]:
        for _ in range(20):
            wrong = near_miss(answer, rng)
            off_by = abs(int(wrong) - int(answer))
            swapped = sorted(wrong.lstrip("-")) == sorted(answer.lstrip("-"))
            assert wrong != answer and (off_by in (1, 10) or swapped)
            assert int(answer) < 0 or int(wrong) >= 0
    assert near_miss("abc", rng) == "abc0"
    # 42: 41, 43, 32, 52 and 24 (digits swapped)
    assert {near_miss("42", random.Random(s)) for s in range(200)} == {"41", "43", "32", "52", "24"}


def test_synthetic_pairs_are_deterministic_and_leave_rows_alone():
    rows = [{"prompt": "1+2=", "ground_truth": "3", "extras": {}, "id": "a"},
            {"prompt": "9+9=", "ground_truth": "18", "extras": {"solution": "18"}, "id": "b"}]
    pairs = synthetic_preferences(rows, 0, chosen_key="good", rejected_key="bad")
    assert pairs == synthetic_preferences(rows, 0, chosen_key="good", rejected_key="bad")
    assert [p["extras"]["good"] for p in pairs] == ["3", "18"]
    assert all(p["extras"]["bad"] != p["extras"]["good"] for p in pairs)
    assert rows[0]["extras"] == {}


def test_text_pairs_are_tokenized_after_the_prompt_with_eos():
    tok = CharTokenizer()
    rows = [{"prompt": "ab", "ground_truth": "", "extras": {"c": "x", "r": "yz"}, "id": "0"}]
    (ex,) = preference_examples(rows, tok, chosen_key="c", rejected_key="r")
    assert ex == PairExample(tok("ab")["input_ids"], tok("x")["input_ids"] + [0], [1, 1],
                             tok("yz")["input_ids"] + [0], [1, 1, 1])


def test_chat_pairs_continue_the_rows_opening_in_either_form():
    # the reply alone, or the whole conversation (TRL's implicit prompt): the same ids after the same prompt
    from rltk.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    user = {"role": "user", "content": "1+2="}
    row = {"prompt": "1+2=", "ground_truth": "3", "id": "r", "messages": [user],
           "extras": {"c": [{"role": "assistant", "content": "3"}],
                      "r": [user, {"role": "assistant", "content": "4"}]}}
    (ex,) = preference_examples([row], tok, chosen_key="c", rejected_key="r")
    assert tok.decode(ex.prompt_ids) == "<|user|>1+2=<|eos|><|assistant|>"
    assert (tok.decode(ex.chosen_ids), tok.decode(ex.rejected_ids)) == ("3<|eos|>", "4<|eos|>")
    assert ex.chosen_mask == ex.rejected_mask == [1, 1]
    text_prompt = {**row, "messages": None}
    with pytest.raises(ConfigError, match="chat responses need a chat prompt"):
        preference_examples([text_prompt], tok, chosen_key="c", rejected_key="r")


@pytest.mark.parametrize("chosen_key, rejected_key, named", [("chosen", "r", "dpo.chosen_key='chosen'"),
                                                             ("c", "rejected", "dpo.rejected_key='rejected'")])
def test_a_missing_column_names_the_config_key(chosen_key, rejected_key, named):
    rows = [{"prompt": "ab", "ground_truth": "", "extras": {"c": "x", "r": "y"}, "id": "0"}]
    with pytest.raises(ConfigError, match=named + r" is not a column of row '0'; its columns: \['c', 'r'\]"):
        preference_examples(rows, CharTokenizer(), chosen_key=chosen_key, rejected_key=rejected_key)


def test_a_response_of_another_type_is_refused():
    rows = [{"prompt": "ab", "ground_truth": "", "extras": {"c": 3, "r": "y"}, "id": "0"}]
    with pytest.raises(ConfigError, match="dpo.chosen_key='c' holds a int"):
        preference_examples(rows, CharTokenizer(), chosen_key="c", rejected_key="r")


def test_pair_batch_interleaves_chosen_and_rejected():
    pairs = [PairExample([1], [2, 0], [1, 1], [3, 4, 0], [1, 1, 1]), PairExample([5, 6], [7, 0], [1, 1], [0], [1])]
    batch = pair_batch(pairs, 0)
    assert batch["group_ids"].tolist() == [0, 0, 1, 1]
    assert batch["response_mask"].sum(-1).tolist() == [2, 3, 2, 1]


def test_online_pairs_take_best_and_worst_of_groups_whose_scores_differ():
    def e(group, score, token):
        return Experience(prompt_ids=[group], response_ids=[token], score=score, group_id=group)

    experiences = [e(0, 0.0, 10), e(0, 1.0, 11), e(0, 0.5, 12), e(0, 1.0, 13),  # best 11 (first max), worst 10
                   e(1, 1.0, 20), e(1, 1.0, 21),                                 # all equal: no pair
                   e(2, 0.0, 30), e(2, 2.0, 31)]                                 # n = 2
    pairs = online_pairs(experiences)
    assert [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in pairs] == [([0], [11], [10]), ([2], [31], [30])]


def test_pair_settings_keep_pairs_whole():
    s = pair_settings(ForwardSettings(micro_batch_size=7, temperature=0.7, max_tokens_per_micro_batch=100))
    assert (s.micro_batch_size, s.temperature, s.max_tokens_per_micro_batch) == (6, 1.0, None)
    assert pair_settings(ForwardSettings(micro_batch_size=1)).micro_batch_size == 2


def _pairs():
    rng = random.Random(0)
    return [PairExample([rng.randrange(1, 30) for _ in range(3)], [rng.randrange(1, 30), 0], [1, 1],
                        [rng.randrange(1, 30), rng.randrange(1, 30), 0], [1, 1, 1]) for _ in range(6)]


def test_first_step_against_its_own_reference_is_log_2_and_raises_the_margin():
    # At the stage's first step the policy is its reference: every h = 0, the sigmoid loss is log 2 per pair,
    # the implicit rewards and margins are 0 and no pair is "won" yet. One step then moves each chosen
    # response up against its rejected one, so the margin turns positive.
    strategy = one_process_strategy()
    reference = FrozenReference.for_stage(strategy, kl_coef=1.0)
    settings = pair_settings(ForwardSettings(micro_batch_size=4))
    batch = pair_batch(_pairs(), 0)
    ref = reference_sequence_logps(reference, batch, settings)
    loss = PreferenceLoss(fn=rltk.get_component("preference_loss", "sigmoid"), args={}, beta=0.5)
    metrics = preference_step(strategy, batch, ref, loss, settings)
    assert metrics["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["rewards/accuracies"] == 0.0
    seq = reference_sequence_logps(FrozenReference(strategy, strategy.full_model_copy()), batch, settings)
    margin = 0.5 * ((seq[0::2] - ref[0::2]) - (seq[1::2] - ref[1::2]))
    assert margin.mean().item() > 0
    after = preference_step(strategy, batch, ref, loss, settings)
    assert after["rewards/margins"] == pytest.approx(margin.mean().item(), abs=1e-5)
    assert after["dpo_loss"] < math.log(2)


def test_micro_batching_does_not_change_the_step():
    batch = pair_batch(_pairs(), 0)
    results = []
    for micro in (2, 12):
        strategy = one_process_strategy()
        reference = FrozenReference.for_stage(strategy, kl_coef=1.0)
        settings = pair_settings(ForwardSettings(micro_batch_size=micro))
        ref = reference_sequence_logps(reference, batch, settings)
        loss = PreferenceLoss(fn=rltk.get_component("preference_loss", "ipo"), args={}, beta=0.5)
        preference_step(strategy, batch, ref, loss, settings)
        results.append(strategy.full_state_dict())
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, atol=1e-6, rtol=0, msg=name)


def test_nll_term_is_the_chosen_tokens_mean_nll_and_only_trains_when_asked():
    batch = pair_batch(_pairs(), 0)
    settings = pair_settings(ForwardSettings(micro_batch_size=4))
    sigmoid = PreferenceLoss(fn=rltk.get_component("preference_loss", "sigmoid"), args={}, beta=0.5)
    states = []
    for coef in (0.0, 1.0):
        strategy = one_process_strategy()
        reference = FrozenReference.for_stage(strategy, kl_coef=1.0)
        tokens = reference.logprobs(batch, settings)[0::2]
        mask = batch["response_mask"][0::2]
        by_hand = -(tokens * mask).sum() / mask.sum()  # 6 chosen responses of 2 tokens each
        metrics = preference_step(strategy, batch, reference_sequence_logps(reference, batch, settings), sigmoid,
                                  settings, nll_coef=coef)
        assert metrics["nll_loss"] == pytest.approx(by_hand.item(), abs=1e-5)
        states.append(strategy.full_state_dict())
    assert any((states[0][k] - states[1][k]).abs().max() > 0 for k in states[0])
