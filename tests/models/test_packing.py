"""Packed rows (rltk.models.packing) give the log-probs and values of the padded layout."""

from __future__ import annotations

import pytest
import torch
import transformers

from rltk.models.critic import build_critic_from_policy, response_values
from rltk.models.logprobs import response_logprobs, response_logprobs_naive
from rltk.models.packing import pack_rows, trim_padding


def _qwen2(attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=61,
                                      attn_implementation=attn)
    return transformers.Qwen2ForCausalLM(config).eval()


def _batch():
    """Prompts of 3, 1 and 2 tokens left-padded to 3; responses of 2, 4 and 1 right-padded to 4."""
    prompts, responses = [[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15, 16], [17]]
    P, T = 3, 4
    ids = torch.zeros(3, P + T, dtype=torch.long)
    mask = torch.zeros(3, P + T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(r)] = torch.tensor(r)
        mask[i, P - len(p):P + len(r)] = 1
    return ids, mask, T


def test_pack_rows_layout_by_hand():
    ids, mask, T = _batch()
    packed = pack_rows(ids, mask, T)
    assert packed.input_ids.tolist() == [[5, 6, 7, 11, 12, 8, 13, 14, 15, 16, 9, 10, 17]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]]
    # response (row, col) -> the packed index of the token before it
    assert list(zip(packed.rows.tolist(), packed.cols.tolist())) == [
        (0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]
    assert packed.predictors.tolist() == [2, 3, 5, 6, 7, 8, 11]
    assert packed.labels.tolist() == [11, 12, 13, 14, 15, 16, 17]
    assert packed.scatter(torch.arange(1.0, 8.0), 3, T).tolist() == [
        [1, 2, 0, 0], [3, 4, 5, 6], [7, 0, 0, 0]]


def test_pack_rows_refuses_a_response_without_a_prompt_token():
    ids = torch.tensor([[0, 4, 5]])
    mask = torch.tensor([[0, 1, 1]])
    with pytest.raises(ValueError, match="row 0 .*empty prompt"):
        pack_rows(ids, mask, 2)


def test_trim_padding_keeps_the_needed_columns():
    ids, mask, T = _batch()
    # rows 1 and 2: prompts of 1 and 2 tokens, responses of 4 and 1
    trimmed_ids, trimmed_mask, width = trim_padding(ids[1:], mask[1:], T)
    assert width == 4 and trimmed_ids.tolist() == [[0, 8, 13, 14, 15, 16], [9, 10, 17, 0, 0, 0]]
    trimmed_ids, trimmed_mask, width = trim_padding(ids[2:], mask[2:], T)
    assert width == 1 and trimmed_ids.tolist() == [[9, 10, 17]] and trimmed_mask.tolist() == [[1, 1, 1]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_each_sequence_alone(attn):
    model = _qwen2(attn)
    ids, mask, T = _batch()
    packed_lp, packed_ent = response_logprobs(model, ids, mask, T, with_entropy=True, pack=True)
    padded_lp, padded_ent = response_logprobs_naive(model, ids, mask, T, with_entropy=True)
    torch.testing.assert_close(packed_lp, padded_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_ent, padded_ent, atol=1e-5, rtol=1e-5)
    for i in range(3):  # each sequence in a batch of its own, no padding at all
        real = mask[i].bool()
        width = int(mask[i, ids.shape[1] - T:].sum())
        alone, _ = response_logprobs_naive(model, ids[i, real][None], mask[i, real][None], width)
        torch.testing.assert_close(packed_lp[i, :width], alone[0], atol=1e-5, rtol=1e-5)
    assert (packed_lp[mask[:, -T:] == 0] == 0).all()


def test_packed_logprobs_would_differ_if_sequences_saw_each_other():
    """The check above has teeth: one flat causal sequence (position ids not restarting) differs."""
    model = _qwen2()
    ids, mask, T = _batch()
    packed = pack_rows(ids, mask, T)
    flat = model(input_ids=packed.input_ids, use_cache=False).logits.log_softmax(-1)[0]
    flat_lp = flat[packed.predictors, packed.labels]
    padded_lp, _ = response_logprobs_naive(model, ids, mask, T)
    assert (flat_lp - padded_lp[packed.rows, packed.cols]).abs().max() > 1e-3


def test_packed_gradients_equal_padded():
    model = _qwen2()
    ids, mask, T = _batch()
    grads = []
    for pack in (False, True):
        model.zero_grad()
        lp, ent = response_logprobs(model, ids, mask, T, with_entropy=True, pack=pack)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_values_equal_padded():
    critic = build_critic_from_policy(_qwen2(), head_init_std=0.1).eval()
    ids, mask, T = _batch()
    padded = response_values(critic, ids, mask, T)
    packed = response_values(critic, ids, mask, T, pack=True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    assert (packed[mask[:, -T:] == 0] == 0).all() and (packed[mask[:, -T:] == 1] != 0).all()
