"""Agents with eyes: an environment whose observation is an image, and the tiny VLM policy that sees it.

The next turn's model input (recorded at the real tiny Qwen2.5-VL's forward inside the real hf engine) holds the
image's tokens where the observation put them and the processor's pixel values of exactly that image.
"""

from __future__ import annotations

import types

import pytest
import torch
from PIL import Image

import rltk
from rltk.environments.base import Environment, StepResult
from rltk.rollout.base import SamplingParams
from rltk.workflows.multi_turn import MultiTurnWorkflow
from tests.builtin_plugins import ensure_registered

COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 180, 60)}


class ShowColour(Environment):
    """A two-turn episode: the policy asks to see, the environment shows a square of the row's colour, and
    the second turn scores 1 if it names the colour. ``image_size`` pixels a side."""

    def __init__(self, image_size: int = 56):
        self.image_size = image_size

    def reset(self, row):
        # a row of a colour task names it; any other row (a recipe run's default task) gets one from its id
        names = sorted(COLOURS)
        self.colour = row["ground_truth"] if row["ground_truth"] in COLOURS else \
            names[sum(map(ord, str(row.get("id")))) % len(names)]
        return [{"role": "user", "content": "Ask to see the square, then name its colour."}]

    def step(self, turn):
        if turn.index == 0:
            picture = Image.new("RGB", (self.image_size, self.image_size), COLOURS[self.colour])
            return StepResult(observation=[{"role": "user", "content": [
                {"type": "image", "image": picture}, {"type": "text", "text": "Its colour?"}]}])
        return StepResult(reward=float(self.colour in turn.text), done=True)


@pytest.fixture(scope="module", autouse=True)
def plugins():
    ensure_registered("tools", "tool_parsers", "multi_turn")
    module = types.ModuleType("multi_turn_image_envs")
    module.rltk_environments = lambda: {"show_colour": ShowColour}
    rltk.register_plugin(module, "multi_turn_image_envs")
    yield
    rltk.unregister_plugin("multi_turn_image_envs")


@pytest.fixture(scope="module")
def vlm():
    from rltk.models.tiny import build_char_tokenizer, build_tiny_processor, build_tiny_vlm

    tokenizer = build_char_tokenizer(vision=True)
    return build_tiny_vlm(tokenizer, seed=1).eval(), tokenizer, build_tiny_processor(tokenizer)


def _recorded_forwards(model):
    """Every forward's ``input_ids`` (the language model's prompt) and every vision-tower call's pixel values and
    grids, in call order: transformers' generate encodes the images once, before the prefill that reads them."""
    from rltk.models.vision.tower import vision_tower

    calls, seen = [], []

    def record(module, args, kwargs):
        calls.append(kwargs["input_ids"].detach().clone())

    def record_tower(module, args, kwargs):
        pixels = args[0] if args else kwargs["hidden_states"]
        grids = args[1] if len(args) > 1 else kwargs["grid_thw"]
        seen.append((len(calls), pixels.detach().clone(), grids.detach().clone()))

    hooks = [model.register_forward_pre_hook(record, with_kwargs=True),
             vision_tower(model).register_forward_pre_hook(record_tower, with_kwargs=True)]
    return calls, seen, hooks


def _workflow(vlm, processor=True, max_turns=2):
    from rltk.rollout.hf import HFRolloutEngine

    model, tokenizer, proc = vlm
    return MultiTurnWorkflow(engine=HFRolloutEngine(model, tokenizer), tokenizer=tokenizer, reward=lambda **_: 0.0,
                             sampling=SamplingParams(n=2, max_new_tokens=3, seed=0),
                             env={"environment": "show_colour", "max_turns": max_turns, "max_total_tokens": 64},
                             processor=proc if processor else None)


def test_the_next_turns_model_input_holds_the_observed_images_tokens_and_pixels(vlm):
    model, tokenizer, processor = vlm
    calls, seen, hooks = _recorded_forwards(model)
    try:
        workflow = _workflow(vlm)
        rows = [{"prompt": "", "ground_truth": colour, "extras": {}, "id": f"r{i}"}
                for i, colour in enumerate(["red", "blue"])]
        episodes, stats = workflow._rollout(rows, workflow.sampling)
    finally:
        for hook in hooks:
            hook.remove()
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert stats["engine_calls"] == 2 and [e.turns for e in episodes] == [2, 2, 2, 2]
    # turn 1 saw no image; before turn 2's prefill the tower encoded the four episodes' images, in episode order
    assert len(seen) == 1
    at, pixels, grids = seen[0]
    assert (calls[0] == image_id).sum() == 0  # turn 1's prefill
    expected = [processor(text=["<|vision_start|><|image_pad|><|vision_end|>"],
                          images=[Image.new("RGB", (56, 56), COLOURS[colour])], return_tensors="pt")["pixel_values"]
                for colour in ("red", "red", "blue", "blue")]  # n=2 episodes of each row
    assert torch.equal(pixels, torch.cat(expected).to(pixels.dtype))  # 16 patches of 14 px per 56 px image
    assert grids.tolist() == [[1, 4, 4]] * 4
    prefill = calls[at]  # the next forward: turn 2's prompt, [4 episodes, width]
    per_image = 16 // 4  # 2 x 2 patches merge into one token: (56 / 28) ** 2 image tokens
    assert prefill.shape[0] == 4 and ((prefill == image_id).sum(dim=1) == per_image).all()
    for row, episode in zip(prefill.tolist(), episodes):
        second_turn = next(i for i in range(1, len(episode.mask)) if episode.mask[i] and not episode.mask[i - 1])
        sent = episode.prompt_ids + episode.response_ids[:second_turn]  # the opening, turn 1, the observation
        assert row[len(row) - len(sent):] == sent and set(row[:len(row) - len(sent)]) <= {tokenizer.pad_token_id}
        text = tokenizer.decode(row, skip_special_tokens=False)
        assert "<|vision_start|>" + "<|image_pad|>" * per_image + "<|vision_end|>Its colour?" in text
    for episode in episodes:
        assert episode.vision.image_grid_thw.tolist() == [[1, 4, 4]] and len(episode.vision.images) == 1
        shown = episode.response_ids.count(image_id)
        assert shown == per_image and all(m == 0 for t, m in zip(episode.response_ids, episode.mask) if t == image_id)


def test_the_record_keeps_a_thumbnail_and_a_text_policy_fails_the_episode_naming_why(vlm):
    import json

    workflow = _workflow(vlm)
    rows = [{"prompt": "", "ground_truth": "green", "extras": {}, "id": "g"}]
    episodes, _ = workflow._rollout(rows, SamplingParams(n=1, max_new_tokens=3, seed=0))
    experience = workflow._experience(rows[0], episodes[0], 0.0, {}, 0.0, 0, None)
    part = experience.info["messages"][2]["content"][0]
    assert (part["type"], part["width"], part["height"]) == ("image", 56, 56)
    assert part["thumbnail"].startswith("data:image/png;base64,") and experience.info["images_shown"] == 1
    json.dumps(experience.info)  # JSON, as a checkpointed buffer and the traces keep it
    blind = _workflow(vlm, processor=False)
    with pytest.warns(RuntimeWarning, match="the policy has no processor"):
        episodes, stats = blind._rollout(rows, SamplingParams(n=1, max_new_tokens=3, seed=0))
    assert stats["env_errors"] == 1 and episodes[0].stop_reason == "env_error"
    assert "1 image(s) but the policy has no processor" in episodes[0].env_error


def test_the_trainer_scores_both_turns_with_the_episodes_image_as_the_engine_sampled_them(vlm):
    """The episodes' experiences carry their images (Experience.vision) into the batch: the trainer's
    teacher-forced log-probs and the engine's sampling log-probs equal one direct forward of each whole episode
    with its image, with image tokens at probability 0 (as the hf engine samples; the environment's image tokens
    themselves keep the full softmax's log-prob),
    and other pixels change the second turn's log-probs but not the first's, which came before the image."""
    from rltk.batch import collate
    from rltk.models.vision.inputs import token_type_ids
    from rltk.models.vision.tower import forget_rope_deltas, vision_token_ids
    from rltk.training.step.forward import ForwardSettings, batched_logprobs

    model, tokenizer, _ = vlm
    workflow = _workflow(vlm)
    experiences = workflow.run([{"prompt": "", "ground_truth": c, "extras": {}, "id": c} for c in ("red", "blue")])
    batch = collate(experiences, tokenizer.pad_token_id)
    settings = ForwardSettings(micro_batch_size=4)
    with torch.no_grad():
        trained, _ = batched_logprobs(model, batch, settings)
    for row, e in enumerate(experiences):
        ids = torch.tensor([e.prompt_ids + e.response_ids])
        forget_rope_deltas(model)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=token_type_ids(ids, model),
                           **e.vision.model_inputs()).logits[0, len(e.prompt_ids) - 1:-1].float()
        targets = torch.tensor(e.response_ids)[:, None]
        direct = logits.log_softmax(-1).gather(-1, targets)[:, 0]
        logits[:, vision_token_ids(model)] = float("-inf")
        sampled = logits.log_softmax(-1).gather(-1, targets)[:, 0]
        # the trainer scores the engines' softmax (rltk.kernels.excluded_tokens); the environment's image
        # placeholders, which no softmax without them can score, keep the full softmax's (finite) log-prob
        excluded = torch.isin(targets[:, 0], torch.tensor(vision_token_ids(model)))
        assert excluded.any()
        torch.testing.assert_close(trained[row, :len(direct)], torch.where(excluded, direct, sampled), atol=1e-5,
                                   rtol=0)
        policy = torch.tensor(e.response_mask).bool()
        torch.testing.assert_close(torch.tensor(e.rollout_logprobs)[policy], sampled[policy], atol=1e-4, rtol=0)
    other = dict(batch, pixel_values=batch["pixel_values"].flip(-1))
    with torch.no_grad():
        moved = (batched_logprobs(model, other, settings)[0] - trained).abs()
    for row, e in enumerate(experiences):
        image_at = e.response_ids.index(tokenizer.convert_tokens_to_ids("<|image_pad|>"))
        assert moved[row, :image_at].max() == 0 and moved[row, image_at:len(e.response_ids)].max() > 1e-3


@pytest.mark.slow  # two warm-up steps and two GRPO steps of the tiny VLM on 2-turn episodes (~15 s)
def test_grpo_trains_the_tiny_vlm_on_episodes_that_show_it_an_image(tmp_path, batches):
    """`rltk run grpo` with the tiny VLM and the image-showing environment, from config alone: every trained row
    carries its episode's image (one 4 x 4 patch grid, 16 patches) into the batch, and the traces keep its
    thumbnail in the transcript."""
    import json

    from rltk.commands.cli import main
    from rltk.training.scaffold.traces import read_traces
    from tests.workflows.test_multi_turn_recipe import TINY

    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY, "model.tiny.vision.depth=2",
                 "rollout.workflow=multi_turn", "env.environment=show_colour", "env.max_turns=2",
                 "env.max_total_tokens=48", "rollout.max_new_tokens=4"]) == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/turns_mean"] for m in lines if "rollout/turns_mean" in m] == [2.0, 2.0]
    assert len(batches) == 2
    image_id = 106  # <|image_pad|> of the char tokenizer with the vision tokens
    for batch in batches:
        rows = batch["input_ids"].shape[0]
        assert batch["image_grid_thw"].tolist() == [[[1, 4, 4]]] * rows
        assert batch["pixel_values"].shape[:2] == (rows, 16)
        assert ((batch["input_ids"] == image_id).sum(-1) == 4).all()
    traces = read_traces(run_dir / "traces.jsonl")
    assert traces and all(t["info"]["images_shown"] == 1 for t in traces)
    part = traces[0]["info"]["messages"][2]["content"][0]
    assert part["type"] == "image" and part["thumbnail"].startswith("data:image/png;base64,")


@pytest.mark.slow  # two GRPO steps of the tiny VLM on one-turn episodes of a 12-row image dataset (~10 s)
def test_grpo_runs_multi_turn_episodes_that_open_with_the_rows_images(tmp_path, batches):
    """A dataset row's images (data.image_key, file paths) open its episode under rollout.workflow=multi_turn:
    the row's {"type": "image"} part takes its image, and each trained row carries the image it showed."""
    import json

    from rltk.commands.cli import main
    from tests.workflows.test_multi_turn_recipe import TINY

    data = tmp_path / "data"
    data.mkdir()
    sizes = {"red": (56, 56), "blue": (56, 28)}
    for name, size in sizes.items():
        Image.new("RGB", size, COLOURS[name]).save(data / f"{name}.png")
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Its colour?"}]}],
             "answer": name, "images": [f"{name}.png"]} for name in ("red", "blue") * 6]
    (data / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    short = [a for a in TINY if not a.startswith(("data.train_size", "data.eval_size"))]
    assert main(["run", "grpo", f"output_dir={tmp_path / 'run'}", *short, "model.tiny.vision.depth=2",
                 f"data.path={data / 'rows.jsonl'}", "data.answer_key=answer", "data.use_chat_template=true",
                 "data.eval_size=2", "data.max_prompt_tokens=64", "rollout.workflow=multi_turn", "env.max_turns=1",
                 "rollout.max_new_tokens=6"]) == 0
    assert len(batches) == 2
    image_id = 106
    for batch in batches:
        grids = batch["image_grid_thw"][:, 0]  # one image a row
        tokens = (batch["input_ids"] == image_id).sum(-1)
        # the processor scales each picture to about 56^2 pixels, aspect kept: the square 4 x 4 patches, the wide 4 x 6
        assert set(map(tuple, grids.tolist())) <= {(1, 4, 4), (1, 4, 6)}
        assert tokens.tolist() == (grids.prod(-1) // 4).tolist()  # each row's own image's tokens
    # the run's traces keep a thumbnail of each traced row's image beside its prompt, at the image's own size
    from rltk.training.scaffold.traces import read_traces

    traces = read_traces(tmp_path / "run" / "traces.jsonl")
    by_id = {f"rows-{i}": sizes[r["answer"]] for i, r in enumerate(rows)}
    assert traces and all([(p["width"], p["height"]) for p in t["images"]] == [by_id[t["row_id"]]] for t in traces)
