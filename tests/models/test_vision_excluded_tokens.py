"""The trainer scores a VLM's tokens under the distribution its rollout engines sample: the softmax without the
image/video placeholders (rltk.kernels.excluded_tokens). Reference: ``log_softmax`` of the model's own full fp32
logits with those ids at -inf, then divided by the temperature; fp32 throughout, tolerance 1e-5 (values) and
1e-5 relative (gradients)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from rltk.kernels import token_logprobs_and_entropy
from rltk.models.logprobs import (
    last_hidden_states,
    response_logprobs,
    response_logprobs_naive,
    shared_prompt_hidden_states,
)
from rltk.models.tiny import build_char_tokenizer, build_tiny_model, build_tiny_processor, build_tiny_vlm
from rltk.models.vision.inputs import token_type_ids
from rltk.models.vision.tower import vision_token_ids

ATOL = 1e-5
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def vlm_batch():
    tokenizer = build_char_tokenizer(vision=True)
    processor = build_tiny_processor(tokenizer)
    model = build_tiny_vlm(tokenizer, seed=3).float()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    rendered = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[rendered, rendered], images=[Image.new("RGB", (56, 56), c) for c in ("red", "blue")],
                    return_tensors="pt")
    response = torch.tensor([tokenizer.encode("blue!", add_special_tokens=False),
                             tokenizer.encode("red..", add_special_tokens=False)])
    ids = torch.cat([out["input_ids"], response], dim=1)
    mask = torch.cat([out["attention_mask"], torch.ones_like(response)], dim=1)
    mask[1, -1] = 0  # one padded response position
    vision = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    return model, ids, mask, response.shape[1], vision


def _reference(model, ids, mask, width, vision):
    logits = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=token_type_ids(ids, model),
                   **vision).logits[:, -(width + 1):-1].float()
    logits[..., vision_token_ids(model)] = float("-inf")
    log_probs = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    valid = mask[:, -width:].bool()
    logprobs = torch.where(valid, log_probs.gather(-1, ids[:, -width:, None]).squeeze(-1), 0.0)
    probs = log_probs.exp()
    entropy = torch.where(valid, -(probs * log_probs.nan_to_num(neginf=0.0)).sum(-1), 0.0)
    sum_pi_squared = torch.where(valid, probs.square().sum(-1), 0.0)
    return logprobs, entropy, sum_pi_squared


def _grads(model, outputs, mask, width):
    weights = torch.linspace(0.5, 1.5, width)
    valid = mask[:, -width:]
    loss = ((outputs[0] * weights - 0.3 * outputs[1]) * valid).sum()
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("path", ["fused-torch", "fused-naive", "naive"])
def test_vlm_logprobs_entropy_and_gradients_exclude_the_vision_tokens(vlm_batch, path):
    model, ids, mask, width, vision = vlm_batch
    assert vision_token_ids(model)
    reference = _reference(model, ids, mask, width, vision)
    reference_grads = _grads(model, reference, mask, width)
    if path == "naive":
        outputs = response_logprobs_naive(model, ids, mask, width, temperature=TEMPERATURE, with_entropy=True,
                                          with_sum_pi_squared=True, vision_inputs=vision)
    else:
        outputs = response_logprobs(model, ids, mask, width, temperature=TEMPERATURE, with_entropy=True,
                                    with_sum_pi_squared=True, impl=path.split("-")[1], vision_inputs=vision)
    for got, want in zip(outputs, reference):
        torch.testing.assert_close(got, want.detach(), atol=ATOL, rtol=0)
    grads = _grads(model, outputs, mask, width)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], atol=ATOL, rtol=1e-5, msg=name)
    # teeth: the full softmax's log-probs differ from these by log(1 - p_vision), far above the tolerance
    assert (reference[0] - _full_softmax_logprobs(model, ids, mask, width, vision)).abs().max() > 1e-2


def _full_softmax_logprobs(model, ids, mask, width, vision):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=token_type_ids(ids, model),
                       **vision).logits[:, -(width + 1):-1].float()
    log_probs = torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, ids[:, -width:, None]).squeeze(-1)
    return torch.where(mask[:, -width:].bool(), log_probs, 0.0)


def test_a_vlm_prompt_shared_by_text_rows_excludes_them_too(vlm_batch):
    model, _, _, _, _ = vlm_batch
    ids = torch.tensor([[3, 5, 7, 9, 11, 13], [3, 5, 7, 10, 12, 14]])  # one prompt, run once (prompt sharing)
    mask = torch.ones_like(ids)
    assert shared_prompt_hidden_states(model, ids, mask, 3) is not None
    with torch.no_grad():
        shared = response_logprobs(model, ids, mask, 3, temperature=TEMPERATURE, with_entropy=True, impl="torch")
        reference = _reference(model, ids, mask, 3, {})
    for got, want in zip(shared, reference):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_a_text_models_outputs_are_the_fused_ops_bit_for_bit():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=1)
    assert vision_token_ids(model) == []
    ids = torch.tensor([[3, 5, 7, 9, 11, 13], [4, 6, 8, 10, 12, 14]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        got = response_logprobs(model, ids, mask, 3, temperature=TEMPERATURE, with_entropy=True,
                                with_sum_pi_squared=True, impl="torch", share_prompts=False)
        hidden = last_hidden_states(model, ids[:, :-1], mask[:, :-1])[:, 2:].reshape(6, -1)
        head = model.get_output_embeddings()
        want = token_logprobs_and_entropy(hidden, head.weight, ids[:, 3:].reshape(-1), temperature=TEMPERATURE,
                                          impl="torch", with_sum_pi_squared=True)
    for g, w in zip(got, want):
        assert torch.equal(g, w.view(2, 3))


def test_an_image_token_inside_the_response_keeps_the_full_softmaxs_logprob_on_both_paths(vlm_batch):
    """An environment turn's image placeholders inside a multi-turn response (masked from the loss): finite
    log-probs, those of the full softmax, and finite gradients, naive and fused alike."""
    model = vlm_batch[0]
    image_id = model.config.image_token_id
    ids = torch.tensor([[3, 5, 7, 9, image_id, 13], [4, 6, 8, 10, 12, 14]])  # text rows: no features to place
    mask, width, vision = torch.ones_like(ids), 3, {}
    full = _full_softmax_logprobs(model, ids, mask, width, vision)
    for outputs in (response_logprobs(model, ids, mask, width, temperature=TEMPERATURE, impl="torch",
                                      vision_inputs=vision),
                    response_logprobs_naive(model, ids, mask, width, temperature=TEMPERATURE, vision_inputs=vision)):
        logprobs = outputs[0]
        assert torch.isfinite(logprobs).all()
        torch.testing.assert_close(logprobs[0, -2], full[0, -2], atol=ATOL, rtol=0)
        model.zero_grad()
        (logprobs * (ids[:, -width:] != image_id)).sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
