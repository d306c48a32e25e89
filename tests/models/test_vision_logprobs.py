"""A VLM's images through the hf engine and the trainer's teacher-forced log-probs (rltk.models.vision.inputs):
the engine's sampled-token log-probs agree with ``response_logprobs`` given each row's own image inputs, within
the text path's tolerance (1e-5, fp32; tests/rollout/test_hf.py), once the engine's renormalisation without the
image tokens (which it never samples) is added back: ``engine = trainer - log(1 - p_vision)``."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from rltk.models.logprobs import response_logprobs
from rltk.models.tiny import build_char_tokenizer, build_tiny_processor, build_tiny_vlm
from rltk.models.vision.inputs import batch_vision_inputs, token_type_ids
from rltk.models.vision.tower import vision_token_ids
from rltk.rollout.base import SamplingParams
from rltk.rollout.hf import HFRolloutEngine

#: The worst |engine - trainer| log-prob gap measured here: 9.5e-7 (fp32, 4 seeds, ATEN_CPU_CAPABILITY avx2, default
#: and the best); the text path's test allows 1e-5. The renormalisation term itself is about 0.035 nats a token.
ATOL = 1e-5


@pytest.fixture(scope="module")
def parts():
    tokenizer = build_char_tokenizer(vision=True)
    return tokenizer, build_tiny_processor(tokenizer), build_tiny_vlm(tokenizer, seed=3)


def _prompt(processor, colours: list[str], text: str) -> tuple[list[int], dict]:
    messages = [{"role": "user", "content": [{"type": "image"}] * len(colours) + [{"type": "text", "text": text}]}]
    rendered = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[rendered], images=[Image.new("RGB", (56, 56), c) for c in colours] or None,
                    return_tensors="pt")
    vision = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]} if colours else None
    return out["input_ids"][0].tolist(), vision


def _teacher_forced(model, pad_id, prompts, visions, groups, n):
    """The rows as rltk's batches hold them: prompt left-padded, response right-padded, each row's own images."""
    rows = [(prompts[i], visions[i], c) for i, group in enumerate(groups) for c in group]
    width_p = max(len(p) for p, _, _ in rows)
    width_t = max(len(c.token_ids) for _, _, c in rows)
    ids = torch.full((len(rows), width_p + width_t), pad_id)
    mask = torch.zeros_like(ids)
    for r, (prompt, _, c) in enumerate(rows):
        ids[r, width_p - len(prompt):width_p] = torch.tensor(prompt)
        ids[r, width_p:width_p + len(c.token_ids)] = torch.tensor(c.token_ids)
        mask[r, width_p - len(prompt):width_p + len(c.token_ids)] = 1
    return ids, mask, width_t, batch_vision_inputs([v for _, v, _ in rows]), rows


def test_engine_logprobs_agree_with_the_trainers_given_each_rows_images(parts):
    tokenizer, processor, model = parts
    specs = [(["red"], "colour?"), (["blue", "yellow"], "which two?"), ([], "1+2=")]  # 1, 2 and no images
    prompts, visions = zip(*(_prompt(processor, colours, text) for colours, text in specs))
    engine = HFRolloutEngine(model, tokenizer)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, stop_token_ids=[], seed=5)
    groups = engine.generate(list(prompts), params, vision_inputs=list(visions))
    ids, mask, width, vision, rows = _teacher_forced(model, tokenizer.pad_token_id, prompts, visions, groups, 3)
    vision_ids = vision_token_ids(model)
    assert not any(set(c.token_ids) & set(vision_ids) for _, _, c in rows)
    with torch.no_grad():
        trainer, _ = response_logprobs(model, ids, mask, width, vision_inputs=vision)
        engine_lps = torch.tensor([c.logprobs for _, _, c in rows])
        # p_vision from the full logits of the same forward (the model's own, with its 3-D positions)
        logits = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=token_type_ids(ids, model),
                       **vision).logits[:, ids.shape[1] - width - 1:-1]
        p_vision = logits.float().softmax(-1)[..., vision_ids].sum(-1)
        torch.testing.assert_close(trainer - torch.log1p(-p_vision), engine_lps, atol=ATOL, rtol=0)
        # teeth: the same tokens with the first prompt's image another colour score otherwise
        other = dict(vision, pixel_values=vision["pixel_values"].flip(0))
        shifted, _ = response_logprobs(model, ids, mask, width, vision_inputs=other)
    assert (shifted - trainer).abs().max() > 1e-3


def test_the_samples_of_a_prompt_see_only_its_images(parts):
    tokenizer, processor, model = parts
    red, red_vision = _prompt(processor, ["red"], "colour?")
    blue, blue_vision = _prompt(processor, ["blue"], "colour?")
    params = SamplingParams(n=2, greedy=True, max_new_tokens=4, stop_token_ids=[])
    engine = HFRolloutEngine(model, tokenizer)
    together = engine.generate([red, blue], params, vision_inputs=[red_vision, blue_vision])
    alone = [engine.generate([p], params, vision_inputs=[v])[0] for p, v in ((red, red_vision), (blue, blue_vision))]
    for joint, single in zip(together, alone):
        assert [c.token_ids for c in joint] == [c.token_ids for c in single]
        torch.testing.assert_close(torch.tensor([c.logprobs for c in joint]),
                                   torch.tensor([c.logprobs for c in single]), atol=ATOL, rtol=0)


def test_packing_rows_with_images_is_refused_with_the_reason(parts):
    tokenizer, processor, model = parts
    prompt, vision = _prompt(processor, ["red"], "colour?")
    ids = torch.tensor([prompt + [10, 11]])
    with pytest.raises(ValueError, match="trainer.pack_sequences.*refused for rows with images"):
        response_logprobs(model, ids, torch.ones_like(ids), 2, pack=True, vision_inputs=vision)
