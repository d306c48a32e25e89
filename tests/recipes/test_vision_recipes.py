"""`rltk run grpo` and `rltk run sft` with the tiny VLM default (model.tiny.vision.depth=2) on rows with images:
the images reach every log-prob pass, a run killed mid-stage resumes bit for bit, and what does not carry
images yet stops with exit 2 naming data.image_key (issue 57, item 4)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rltk.commands.cli import main
from tests.crash import crash_at_step

COLOURS = {"red": (230, 20, 20), "green": (20, 200, 40), "blue": (30, 40, 220)}
VLM = ["model.tiny.vision.depth=2", "data.task=null", "data.use_chat_template=true", "data.eval_size=2",
       "rollout.max_new_tokens=4", "data.max_prompt_tokens=256", "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.resume=never"]
RL_ONLY = "stages=[{name: rl, type: rl}]"
GRPO = [*VLM, RL_ONLY, "trainer.total_steps=2", "trainer.warmup_steps=0", "trainer.prompts_per_step=2",
        "rollout.n=2", "trainer.micro_batch_size=2", "checkpoint.every=0", "trainer.eval_every=0"]


@pytest.fixture
def image_rows(tmp_path) -> Path:
    """Twelve rows "what colour?" over one image each: PNG files beside the data for half of them, pixel
    arrays inline for the rest; the answer is the colour's name."""
    folder = tmp_path / "data"
    folder.mkdir()
    rows = []
    for index in range(12):
        name = list(COLOURS)[index % 3]
        pixels = np.full((28 + 14 * (index % 2), 56, 3), COLOURS[name], dtype=np.uint8)
        if index % 2:
            Image.fromarray(pixels).save(folder / f"{index}.png")
            image = f"{index}.png"
        else:
            image = pixels.tolist()
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}]
        rows.append({"prompt": prompt, "answer": name, "solution": name, "images": [image]})
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def counted_passes(monkeypatch):
    """How many forwards of each kind got image inputs (and how many had none): every pass of a VLM batch
    goes through one of these two readers of the batch's padded fields."""
    import rltk.training.step.micro_batches as passes
    import rltk.training.updates.sft as sft

    counts = {"rl": [0, 0], "sft": [0, 0]}

    def counting(module, kind):
        original = module.vision_inputs_of

        def read(data):
            inputs = original(data)
            counts[kind][inputs is None] += 1
            return inputs

        monkeypatch.setattr(module, "vision_inputs_of", read)

    counting(passes, "rl")
    counting(sft, "sft")
    return counts


@pytest.mark.slow  # two GRPO steps of the tiny VLM (~10 s)
def test_grpo_on_rows_with_images_feeds_them_to_every_pass(tmp_path, image_rows, counted_passes):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", f"data.path={image_rows}", *GRPO,
                 "algorithm.kl_coef=0.05", "trainer.ppo_epochs=2"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "pg_loss" in row]
    assert [row["step"] for row in trained] == [1, 2] and all(np.isfinite(row["pg_loss"]) for row in trained)
    # per step: the old-log-prob pass, the reference pass and two epochs of the update, 2 micro-batches each
    with_images, without = counted_passes["rl"]
    assert with_images == 2 * 4 * 2 and without == 0


@pytest.mark.slow  # three warm-up steps of the tiny VLM (~8 s)
def test_sft_on_rows_with_images_sees_their_features(tmp_path, image_rows, counted_passes):
    run_dir = tmp_path / "sft"
    assert main(["run", "sft", f"output_dir={run_dir}", f"data.path={image_rows}", *VLM, "sft.steps=3",
                 "sft.warmup_steps=0", "sft.batch_size=4", "trainer.micro_batch_size=2", "sft.eval_every=0",
                 "checkpoint.every=0"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["sft/sft_loss"] for row in rows if "sft/sft_loss" in row]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert counted_passes["sft"] == [3 * 2, 0]


def _numbers(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_per_s"))} for row in rows]


def _last_weights(run_dir: Path) -> str:
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return hashlib.sha256((last / "model" / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.slow  # a 4-step straight run, one crashing at step 3 and its resume (~25 s)
def test_a_vlm_run_killed_mid_stage_resumes_bit_for_bit(tmp_path, image_rows):
    # the staleness buffer keeps half of each step's experiences (with their images) across the checkpoint
    args = [f"data.path={image_rows}", *GRPO, "trainer.total_steps=4", "checkpoint.every=2",
            "buffer.sample_strategy=staleness", "buffer.sample_strategy_args={max_staleness: 2, batch_size: 2}"]
    args = [a for a in args if a != "checkpoint.resume=never"]
    straight, crashing = tmp_path / "straight", tmp_path / "crashing"
    assert main(["run", "grpo", f"output_dir={straight}", *args]) == 0
    with crash_at_step(3):
        main(["run", "grpo", f"output_dir={crashing}", *args])
    # the checkpoint it resumes from holds kept experiences, each with its prompt's processor outputs
    state = json.loads((crashing / "checkpoints" / "step_000002" / "state.json").read_text())["state"]
    kept = state["per_rank"][0]["buffer"]["items"]
    assert kept and all(item["experience"]["vision"]["image_grid_thw"] for item in kept)
    assert main(["run", "grpo", f"output_dir={crashing}", *args]) == 0
    assert _numbers(crashing) == _numbers(straight)
    assert _last_weights(crashing) == _last_weights(straight)


@pytest.mark.parametrize("recipe, overrides, message", [
    ("grpo", ["trainer.mode=one_step_off"], "trainer.mode=one_step_off does not carry images"),
    ("dpo", ["stages=[{name: prefs, type: dpo}]"], "the dpo stage"),
    ("ppo", [], "the ppo stage (its critic"),
    ("grpo", ["model.tiny.vision.depth=0"], "is a text model"),
], ids=["one_step_off", "dpo", "ppo", "text-policy"])
def test_what_does_not_carry_images_exits_2_naming_the_key(tmp_path, capsys, image_rows, recipe, overrides, message):
    code = main(["run", recipe, f"output_dir={tmp_path / 'run'}", f"data.path={image_rows}", *GRPO, *overrides])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "data.image_key='images'" in err and "Traceback" not in err, err


def test_a_missing_image_file_exits_2_naming_the_row_key_and_file(tmp_path, capsys, image_rows):
    rows = image_rows.read_text().splitlines()
    broken = json.loads(rows[1])
    broken["images"] = ["gone.png"]
    image_rows.write_text("\n".join([rows[0], json.dumps(broken), *rows[2:]]) + "\n")
    assert main(["run", "grpo", f"output_dir={tmp_path / 'run'}", f"data.path={image_rows}", *GRPO]) == 2
    err = capsys.readouterr().err
    assert "gone.png' does not exist" in err and "data.image_key" in err and "row" in err and "Traceback" not in err


@pytest.mark.slow  # one vLLM start and two GRPO steps of the tiny VLM (~40 s on 2 cores)
def test_grpo_with_the_vllm_engine_samples_with_the_images(tmp_path, image_rows):
    """rollout.engine=vllm: the rows' images reach vLLM as its multimodal inputs (rltk.rollout.vllm_vision) and
    the engine samples from the trainer's weights (its log-probs against the trainer's: mismatch ratios)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", f"data.path={image_rows}", *GRPO, "rollout.engine=vllm",
                 "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",  # head size 32: vLLM's CPU attention has it
                 "algorithm.rollout_correction.log_metrics=true"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [row for row in rows if "mismatch/kl" in row]
    assert len(rl) == 2 and all(np.isfinite(r["pg_loss"]) for r in rl)
    for r in rl:
        # Per-token pi_trainer / pi_vllm. Both engines sample with the vision tokens banned (probability 0,
        # the rest renormalised) and the trainer scores that same softmax (rltk.kernels.excluded_tokens): every
        # ratio is 1 within the text run's tolerance (tests/rollout/test_vllm_run.py). Scoring the plain softmax
        # (the trainer before) gave 1 - p(vision tokens), 0.961-0.969 here; weights other than the trainer's (a
        # missed sync) would scatter them both ways.
        assert abs(r["mismatch/ratio_max"] - 1) < 1e-3 and abs(r["mismatch/ratio_min"] - 1) < 1e-3
