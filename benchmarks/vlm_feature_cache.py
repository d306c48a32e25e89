"""The frozen vision tower's feature cache (rltk.models.vision.features): one RL step's passes with and without it
(issue 57, item 4).

One step of GRPO on a VLM runs the same images through the tower in every pass: the old-log-prob pass, the
reference pass and the update's forward (each epoch). With ``model.freeze_vision_tower`` (the default) the
trainer computes each image's features once per step and every later pass reuses them. This times exactly
those passes (no generation) on the tiny VLM (``build_tiny_vlm``; ``--depth``/``--vision-width`` grow its
tower, ``--image-size`` its images), ``--prompts`` prompts of one image each, ``--n`` samples per prompt:

* ``old`` and ``ref``: :func:`rltk.training.step.forward.batched_logprobs` without gradients;
* ``update``: ``--epochs`` forward + backward passes over the micro-batches, as the update runs them.

Reported: the median over ``--rounds`` of the CPU time of the timing thread of the whole step and of the
tower alone (a forward hook), for each mode, the tower runs (images) each did, and the step's saving.
Threads default to 1 (a shared machine's parked thread swings wall times several-fold). JSON under
``benchmarks/results/``.

    python benchmarks/vlm_feature_cache.py                       # the tiny default's tower (~30 s)
    python benchmarks/vlm_feature_cache.py --depth 8 --vision-width 128 --image-size 112
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from rltk.batch import Experience, collate  # noqa: E402
from rltk.models.tiny import build_char_tokenizer, build_tiny_processor, build_tiny_vlm  # noqa: E402
from rltk.models.vision.features import ImageFeatureCache  # noqa: E402
from rltk.models.vision.inputs import encode_prompt  # noqa: E402
from rltk.models.vision.tower import freeze_vision_tower  # noqa: E402
from rltk.training.step.forward import ForwardSettings, batched_logprobs  # noqa: E402
from rltk.training.step.micro_batches import micro_batches  # noqa: E402


RESULTS = Path(__file__).resolve().parent / "results"


def build(args):
    tokenizer = build_char_tokenizer(vision=True)
    processor = build_tiny_processor(tokenizer, args.image_size)
    model = build_tiny_vlm(tokenizer, depth=args.depth, vision_hidden_size=args.vision_width,
                           vision_heads=max(2, args.vision_width // 32), seed=0).float()
    freeze_vision_tower(model)
    generator = torch.Generator().manual_seed(0)
    experiences = []
    for prompt in range(args.prompts):
        pixels = torch.randint(0, 256, (args.image_size, args.image_size, 3), generator=generator, dtype=torch.uint8)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"what is {prompt}?"}]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids, vision = encode_prompt(processor, text, [Image.fromarray(pixels.numpy())])
        for _ in range(args.n):
            response = torch.randint(30, 60, (args.response_tokens,), generator=generator).tolist()
            experiences.append(Experience(prompt_ids=ids, response_ids=response, score=0.0, group_id=prompt,
                                          vision=vision))
    return tokenizer, model, collate(experiences, tokenizer.pad_token_id)


def one_step(model, batch, settings: ForwardSettings, epochs: int) -> None:
    """The passes of one step: old and reference log-probs, then ``epochs`` of forward + backward."""
    batched_logprobs(model, batch, settings)  # old
    batched_logprobs(model, batch, settings)  # reference (a LoRA run's: the same module, adapters off)
    width = batch["response_mask"].shape[1]
    for _ in range(epochs):
        for mb in micro_batches(None, batch, micro_batch_size=settings.micro_batch_size):
            logprobs, _ = settings.logprobs(model, mb.data, width)
            (logprobs * mb.data["response_mask"]).sum().backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-tokens", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--vision-width", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "vlm_feature_cache.json")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    _, model, batch = build(args)
    settings = ForwardSettings(micro_batch_size=args.micro_batch_size)
    tower_time, tower_images, starts = [0.0], [0], []
    tower = model.model.visual

    def tower_started(module, inputs):
        starts.append(time.thread_time())

    def tower_done(module, inputs, kwargs, output):  # returns None: the output stays the tower's
        tower_time[0] += time.thread_time() - starts.pop()
        tower_images[0] += kwargs["grid_thw"].shape[0]

    tower.register_forward_pre_hook(tower_started)
    tower.register_forward_hook(tower_done, with_kwargs=True)
    results = {}
    one_step(model, batch, settings, args.epochs)  # warm-up
    for mode in ("no cache", "cache") * args.rounds:
        tower_time[0], tower_images[0] = 0.0, 0
        cache = ImageFeatureCache()
        tick = time.thread_time()
        with cache.serving([model] if mode == "cache" else []):
            one_step(model, batch, settings, args.epochs)
        results.setdefault(mode, []).append((time.thread_time() - tick, tower_time[0], tower_images[0]))
    tokens = int(batch["attention_mask"].sum())
    print(f"one step's passes (old, ref, {args.epochs} update epoch(s)): {args.prompts} prompts x n={args.n}, "
          f"{tokens} tokens, tower depth {args.depth} width {args.vision_width}, images {args.image_size}px, "
          f"threads {torch.get_num_threads()}, median of {args.rounds} rounds (CPU s of the timing thread)")
    print(f"{'mode':<10} {'step s':>8} {'tower s':>8} {'tower images':>13}")
    table = {}
    for mode, rows in results.items():
        step, tower_s, images = (statistics.median(column) for column in zip(*rows))
        table[mode] = {"step_s": step, "tower_s": tower_s, "tower_images": int(images)}
        print(f"{mode:<10} {step:8.3f} {tower_s:8.3f} {int(images):13d}")
    saving = 1 - table["cache"]["step_s"] / table["no cache"]["step_s"]
    print(f"saving: {saving:.1%} of the step's pass time")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "results": table,
                                    "saving": saving}, indent=1))


if __name__ == "__main__":
    main()
