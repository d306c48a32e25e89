"""Rollout traces (rltk/training/scaffold/traces.py): which rows are kept, what a record holds, the cap, resume,
and a real `rltk run grpo` on the embedded tiny default writing them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rltk.batch import Experience, collate
from rltk.buffer.buffer import BufferItem, ExperienceBuffer
from rltk.training.scaffold.traces import TRACES_FILE, TraceWriter, pick_rows, read_traces


class CharTokenizer:
    """Decodes id i as chr(ord('a') + i): enough to check the per-token view."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def stage(first_step=100, name="grpo"):
    cfg = OmegaConf.create({"stages": [{"name": "warmup"}, {"name": name}]})
    return SimpleNamespace(first_step=first_step, index=1, run=SimpleNamespace(cfg=cfg))


def test_pick_rows_takes_whole_groups_in_order_of_first_appearance():
    groups = [7, 7, 3, 3, 7, 9, 9, 3]  # group 7: rows 0,1,4; group 3: rows 2,3,7; group 9: rows 5,6
    assert pick_rows(groups, 6) == [0, 1, 4, 2, 3, 7]
    assert pick_rows(groups, 5) == [0, 1, 4, 5, 6]  # group 3 does not fit whole, group 9 does
    assert pick_rows(groups, 2) == [0, 1]  # the first group alone is cut to fit rather than show nothing
    assert pick_rows(groups, 100) == [0, 1, 4, 2, 3, 7, 5, 6]


def batch_and_items():
    exps = [
        Experience([1, 2], [0, 1, 2], 1.0, 0, reward_details={"exact_match": 1.0}, rollout_logprobs=[-0.5, -1.0, -2.0],
                   info={"prompt": "P0", "response": "abc", "ground_truth": "abc", "row_id": "r0", "sample_index": 0}),
        Experience([1, 2], [3], 0.0, 0, reward_details={"exact_match": 0.0}, rollout_logprobs=[-0.25],
                   finish_reason="length",
                   info={"prompt": "P0", "response": "d", "ground_truth": "abc", "row_id": "r0", "sample_index": 1}),
        # a multi-turn episode: assistant token, two observation tokens (mask 0), assistant token
        Experience([4], [0, 5, 6, 1], 2.0, 1, response_mask=[1, 0, 0, 1], rollout_logprobs=[-1.0, 0.0, 0.0, -1.0],
                   reward_details={"exact_match": 1.0},
                   info={"prompt": "P1", "response": "ab", "ground_truth": "b", "row_id": "r1", "sample_index": 0,
                         "messages": [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "fg"},
                                      {"role": "assistant", "content": "b"}], "tool_calls": 1}),
    ]
    batch = collate(exps, pad_token_id=0)
    # advantages as a per-token estimator might give them (hand-chosen: the mean over policy tokens is checkable)
    batch["advantages"] = torch.tensor([[1.0, 2.0, 3.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.5, 9.0, 9.0, 1.5]])
    items = [BufferItem(exps[0], 5), BufferItem(exps[1], 3), BufferItem(exps[2], 0, source="expert")]
    return batch, items


def test_records_hold_prompt_rewards_advantage_and_the_per_token_view():
    batch, items = batch_and_items()
    writer = TraceWriter("/nonexistent", CharTokenizer(), per_step=16)
    r0, r1, r2 = writer.records(stage(), 5, batch, items)
    assert (r0["step"], r0["stage"], r0["stage_step"], r0["row"], r0["group_id"]) == (105, "grpo", 5, 0, 0)
    assert (r0["prompt"], r0["response"], r0["ground_truth"], r0["row_id"]) == ("P0", "abc", "abc", "r0")
    assert r0["rewards"] == {"exact_match": 1.0} and r0["score"] == 1.0
    assert r0["advantage"] == pytest.approx(2.0)  # (1 + 2 + 3) / 3 policy tokens
    assert r0["tokens"] == ["a", "b", "c"] and r0["token_ids"] == [0, 1, 2]
    assert r0["response_mask"] == [1, 1, 1] and r0["advantages"] == [1.0, 2.0, 3.0]
    assert r0["logprobs"] == [-0.5, -1.0, -2.0]
    assert r0["token_rewards"] == [0.0, 0.0, 1.0]  # the score on the last token
    assert (r0["source"], r0["staleness"]) == ("policy", 0)
    assert (r1["staleness"], r1["finish_reason"], r1["response_tokens"]) == (2, "length", 1)  # put at step 3
    # the observation tokens are in the per-token view with mask 0, and out of the sequence's advantage
    assert r2["response_mask"] == [1, 0, 0, 1] and r2["tokens"] == ["a", "f", "g", "b"]
    assert r2["advantage"] == pytest.approx(1.0) and r2["policy_tokens"] == 2
    assert r2["source"] == "expert" and r2["staleness"] is None
    assert r2["info"]["messages"][1] == {"role": "tool", "content": "fg"} and r2["info"]["tool_calls"] == 1
    assert "prompt" not in r2["info"]  # written once, at the top level


def test_records_keep_a_thumbnail_of_each_prompt_image_and_of_images_in_the_transcript(tmp_path):
    """A row's images (row id -> images) become the record's ``images`` thumbnails in the prompt's order, once
    per row; an image content part in ``info["messages"]`` (an environment's observation) becomes the same
    thumbnail part, so the record stays plain JSON."""
    import base64
    import io

    from PIL import Image

    from rltk.data.images import THUMBNAIL_PREFIX

    def pixel(part):
        data = base64.b64decode(part["thumbnail"][len(THUMBNAIL_PREFIX):])
        return Image.open(io.BytesIO(data)).convert("RGB").getpixel((0, 0))

    batch, items = batch_and_items()
    seen = Image.new("RGB", (8, 8), (0, 200, 0))
    items[2].experience.info["messages"].insert(
        2, {"role": "user", "content": [{"type": "image", "image": seen}, {"type": "text", "text": "look"}]})
    red, blue = Image.new("RGB", (100, 50), (255, 0, 0)), Image.new("RGB", (30, 30), (0, 0, 255))
    writer = TraceWriter(tmp_path, CharTokenizer(), row_images={"r0": [red, blue]})
    r0, r1, r2 = writer.records(stage(), 5, batch, items)
    assert [(p["width"], p["height"], pixel(p)) for p in r0["images"]] == [(100, 50, (255, 0, 0)), (30, 30, (0, 0, 255))]
    assert r1["images"] is writer.thumbnails("r0")  # made once per row, however often it is traced
    assert r2["images"] == []  # row r1 has no images
    part = r2["info"]["messages"][2]["content"][0]
    assert (part["type"], part["width"], pixel(part)) == ("image", 8, (0, 200, 0)) and "image" not in part
    assert writer.write(stage(), 6, batch, items) == 3
    back = read_traces(tmp_path / TRACES_FILE)
    assert back[0]["images"] == r0["images"] and back[2]["info"]["messages"][2]["content"][0] == part
    assert TraceWriter(tmp_path / "text", CharTokenizer()).records(stage(), 5, batch, items)[0]["images"] == []


def test_an_async_steps_traces_count_staleness_from_the_policy_version_the_queue_recorded(tmp_path):
    """Queue -> lease -> the step's buffer -> trace records, as recipes/grpo.py runs them: each trace's
    staleness is the trainer's version minus the version of the sample's oldest token, the queue's
    staleness/* (not 0 because the lease and the training step are the same step)."""
    from rltk.buffer.buffer import trainer_version
    from rltk.training.rollouts.asynchronous.queue import ExperienceQueue
    from rltk.buffer.strategies import OnPolicy
    from rltk.training.rollouts.collect import Rollout
    from rltk.training.stages.loop_state import LoopState, StageContext, sampled_batch

    def group(g, prompt):
        return [Experience([1, prompt], [2 + i, 3], float(i), g, info={"prompt": f"P{prompt}", "sample_index": i})
                for i in range(2)]

    with ExperienceQueue(tmp_path / "q.sqlite", max_staleness=1) as queue:
        queue.put(group(0, 10), ids=["p-b0-0", "p-b0-1"], versions=2, producer="p")  # sampled by version 2
        queue.put(group(0, 11), ids=["p-b1-0", "p-b1-1"], versions=3, producer="p")  # by the trainer's version
        # a rollout continued across a weight update: its oldest token is version 2's
        queue.put(group(0, 12), ids=["p-b1-2", "p-b1-3"], versions=[[2, 3], [3, 3]], producer="p")
        step = 4
        lease = queue.take(6, step=step, version=trainer_version(step))
    assert lease.sampled_versions == [2, 2, 3, 3, 2, 3]
    run = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0), cfg=stage().run.cfg)
    loop = LoopState(sampler=None, buffer=ExperienceBuffer())
    parts = SimpleNamespace(sample_strategy=OnPolicy(), plan=SimpleNamespace(reward_components=False))
    the_stage = SimpleNamespace(first_step=20, index=1, run=run)
    batch = sampled_batch(StageContext(the_stage, loop, None, parts), Rollout(lease.experiences, {},
                                                                             lease.sampled_versions), step)
    records = TraceWriter(tmp_path, CharTokenizer()).records(the_stage, step, batch, loop.batch_items)
    assert [r["staleness"] for r in records] == [1, 1, 0, 0, 1, 0]  # trainer version 3 minus 2, 2, 3, 3, 2, 3
    assert sum(r["staleness"] for r in records) / 6 == pytest.approx(lease.metrics["staleness/mean"])
    assert max(r["staleness"] for r in records) == lease.metrics["staleness/max"] == 1


def test_every_and_the_size_cap(tmp_path, capsys):
    batch, items = batch_and_items()
    writer = TraceWriter(tmp_path, CharTokenizer(), per_step=2, every=2)
    assert writer.write(stage(), 1, batch, items) == 0  # not a traced step
    assert writer.write(stage(), 2, batch, items) == 2  # group 0 (rows 0 and 1); group 1 does not fit
    one_step = (tmp_path / TRACES_FILE).stat().st_size
    capped = TraceWriter(tmp_path / "capped", CharTokenizer(), per_step=2, max_mb=2.5 * one_step / 2**20)
    (tmp_path / "capped").mkdir()
    assert [capped.write(stage(), s, batch, items) for s in (1, 2, 3, 4)] == [2, 2, 0, 0]
    assert (tmp_path / "capped" / TRACES_FILE).stat().st_size == 2 * one_step  # two whole steps, never a cut line
    assert [r["stage_step"] for r in read_traces(tmp_path / "capped" / TRACES_FILE)] == [1, 1, 2, 2]
    assert "traces_max_mb" in capsys.readouterr().out


def test_resume_drops_the_lines_after_the_checkpoint(tmp_path):
    path = tmp_path / TRACES_FILE
    path.write_text("".join(json.dumps({"step": s, "row": 0}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "ro')
    TraceWriter(tmp_path, CharTokenizer(), resume_step=2)
    assert [r["step"] for r in read_traces(path)] == [1, 2]
    assert read_traces(path, step=2) == [{"step": 2, "row": 0}]
    TraceWriter(tmp_path, CharTokenizer(), resume_step=0)  # a new run in the folder starts an empty file
    assert path.read_text() == ""


@pytest.mark.slow
def test_a_real_grpo_run_writes_traces_of_every_rl_step(tmp_path):
    from rltk.commands.cli import main

    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", "logging.logger=[jsonl]", "logging.plot=false",
                 "data.train_size=40", "data.eval_size=8", "sft.steps=4", "sft.stop_at_accuracy=null",
                 "sft.warmup_steps=1", "trainer.total_steps=3", "trainer.warmup_steps=0", "trainer.prompts_per_step=4",
                 "rollout.n=4", "trainer.eval_every=0", "logging.traces_per_step=6", "checkpoint.every=0",
                 # two reward functions (one a plugin's), the second graded by length so that scores differ
                 "reward.reward_fn=[exact_match,overlong_penalty]",
                 "reward.reward_fn_args.overlong_penalty={max_length: 4, buffer_length: 4}"]) == 0
    traces = read_traces(run_dir / TRACES_FILE)
    # 3 RL steps after the 4 warm-up steps; 6 rows per step = one whole group of 4 (a second does not fit)
    assert [r["step"] for r in traces] == [5] * 4 + [6] * 4 + [7] * 4
    assert {r["stage"] for r in traces} == {"grpo"}
    differing = 0
    for step in (5, 6, 7):
        group = [r for r in traces if r["step"] == step]
        assert len({r["group_id"] for r in group}) == 1 and len({r["prompt"] for r in group}) == 1
        differing += len({r["score"] for r in group}) > 1
        scores = [r["score"] for r in group]
        # GRPO: (score - group mean) / (group std + eps), the same on every token of a response
        mean = sum(scores) / 4
        std = (sum((s - mean) ** 2 for s in scores) / 3) ** 0.5
        for r in group:
            assert set(r["rewards"]) == {"exact_match", "overlong_penalty"}
            assert r["rewards"]["exact_match"] == (1.0 if r["response"].strip() == r["ground_truth"] else 0.0)
            assert r["rewards"]["overlong_penalty"] == pytest.approx(-min(len(r["response"]), 5) / 4 if len(
                r["response"]) <= 4 else -1.0)
            assert r["score"] == pytest.approx(sum(r["rewards"].values()), abs=1e-5)
            expected = 0.0 if std == 0 else (r["score"] - mean) / (std + 1e-6)
            assert r["advantage"] == pytest.approx(expected, abs=1e-4)
            assert r["advantages"] == [pytest.approx(expected, abs=1e-3)] * r["response_tokens"]
            assert r["response_mask"] == [1] * r["response_tokens"]
            assert len(r["tokens"]) == len(r["logprobs"]) == r["response_tokens"]
            assert all(lp <= 0 for lp in r["logprobs"])
            # the per-token view spells the response (special tokens, which the response text skips, aside)
            assert r["response"] in re.sub(r"<\|[a-z_]+\|>", "", "".join(r["tokens"]))
            assert (r["source"], r["staleness"]) == ("policy", 0)
    assert differing  # at least one group with differing scores, so the advantage check above is not 0 == 0


def runs_of(mask: list[int], value: int) -> int:
    """How many maximal runs of ``value`` the mask has (the turns of one kind)."""
    return sum(1 for i, m in enumerate(mask) if m == value and (i == 0 or mask[i - 1] != value))


@pytest.mark.slow
def test_multi_turn_traces_hold_the_turns_and_the_environments_observations(tmp_path):
    from rltk.commands.cli import main
    from tests.builtin_plugins import ensure_registered

    ensure_registered("tasks", "guess_number", "multi_turn")
    run_dir = tmp_path / "run"
    config = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "multi_turn.yaml"
    assert main(["run", "grpo", "--config", str(config), f"output_dir={run_dir}", "data.train_size=20",
                 "data.eval_size=4", "sft.steps=2", "sft.stop_at_accuracy=null", "sft.warmup_steps=0",
                 "trainer.total_steps=2", "trainer.warmup_steps=0", "trainer.prompts_per_step=2", "rollout.n=2",
                 "trainer.eval_every=0", "checkpoint.every=0", "logging.logger=[jsonl]", "logging.plot=false"]) == 0
    traces = read_traces(run_dir / TRACES_FILE)
    assert [r["step"] for r in traces] == [3] * 4 + [4] * 4
    for r in traces:
        mask, info = r["response_mask"], r["info"]
        assert 0 in mask and r["policy_tokens"] == sum(mask) < r["response_tokens"]
        assert runs_of(mask, 1) == info["turns"] == sum(m["role"] == "assistant" for m in info["messages"])
        # every observation the environment sent after the first prompt is in the tokens the policy did not write
        observed = "".join(t for t, m in zip(r["tokens"], mask) if m == 0)
        for message in info["messages"][1:]:
            if message["role"] != "assistant":
                assert message["content"] in observed
        assert r["advantages"][mask.index(0)] == 0.0  # no advantage on an observation token
