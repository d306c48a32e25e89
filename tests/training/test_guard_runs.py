"""Diverging runs stop with exit status 3 and a message naming the symptom, the step and the last good
checkpoint, in the warm-up and in the RL stage of both recipes. Before the guard each of them exited 0."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from rltk.commands.cli import main
from rltk.models.tiny import build_char_tokenizer
from rltk.strategies.accelerate_strategy import AccelerateStrategy
from rltk.training.scaffold.guard import EXIT_DIVERGED

TINY = ["sft.stop_at_accuracy=null", "sft.warmup_steps=0", "trainer.warmup_steps=0", "data.train_size=60",
        "data.eval_size=8", "trainer.prompts_per_step=4", "rollout.n=4", "trainer.eval_every=0",
        "checkpoint.resume=never", "checkpoint.keep_last=20", "logging.logger=[jsonl]", "logging.plot=false"]


def run(recipe: str, tmp_path, *overrides: str) -> tuple[int, str]:
    return main(["run", recipe, f"output_dir={tmp_path / 'run'}", *TINY, *overrides]), str(tmp_path / "run")


@pytest.mark.slow  # 4 warm-up and 4 RL steps of a tiny model (~8 s)
@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_rl_at_lr_1e3_stops_on_entropy_collapsed_to_uniform(recipe, tmp_path, capsys):
    # An entropy bonus gives the first RL step a gradient whatever the rewards; at lr 1e3 one Adam
    # step (every weight moves by ~1e3) leaves the policy uniform over the vocabulary.
    rc, run_dir = run(recipe, tmp_path, "sft.steps=4", "trainer.total_steps=12", "trainer.lr=1e3",
                      "algorithm.entropy_coef=0.01", "checkpoint.every=2", "guard.entropy_patience=3",
                      "critic.warmup_steps=0")  # ppo: the policy trains from the first RL step
    err = capsys.readouterr().err
    assert rc == EXIT_DIVERGED == 3, err[-3000:]
    message = err[err.index("rltk: error: "):]
    vocab = len(build_char_tokenizer())  # the embedded default's vocabulary
    uniform = re.escape(f"{math.log(vocab):.3f}")
    found = re.search(r"training diverged at step (\d+) \(step (\d+) of stage '(\w+)'\): mean token entropy "
                      rf"\(entropy\) has been {uniform} nats, 100\.00% of the uniform distribution's log\(V={vocab}\) = "
                      rf"{uniform}, for 3 steps in a row \(since step (\d+)\), above guard.entropy_max=0.999: the policy "
                      r"collapsed to uniform output", message)
    assert found, message
    stop, stage_step, stage, since = int(found[1]), int(found[2]), found[3], int(found[4])
    assert (stage, stop - stage_step, stop - since) == (recipe, 4, 2)  # 4 warm-up steps; 3 bad steps in a row
    assert "trainer.lr=1000.0" in message and "Traceback" not in err

    # what was logged agrees: uniform from `since` on, not before; nothing after the stop
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    entropy = {m["step"]: m["entropy"] for m in logged if "entropy" in m}
    assert max(m["step"] for m in logged) == max(entropy) == stop and min(entropy[s] for s in range(since, stop + 1)) > 0.999 * math.log(vocab)
    assert entropy[since - 1] < 0.999 * math.log(vocab)
    # The weights step since-1 left gave the uniform entropy at `since`: the last good checkpoint is the
    # newest older than since-1 (checkpoints every 2 steps)
    good = max(s for s in range(2, since - 1) if s % 2 == 0)
    assert f"Last good checkpoint: {run_dir}/checkpoints/step_{good:06d} " in message
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow  # a few warm-up steps (~5 s)
def test_warm_up_at_lr_1e6_stops_on_entropy_collapsed_to_uniform(tmp_path, capsys):
    # From a random init (entropy 99.4% of log V at step 1) one step at 1e6 makes it exactly uniform.
    rc, run_dir = run("grpo", tmp_path, "sft.steps=12", "sft.lr=1e6", "checkpoint.every=1",
                      "guard.entropy_patience=3")
    err = capsys.readouterr().err
    assert rc == EXIT_DIVERGED, err[-3000:]
    assert "training diverged at step 4 (step 4 of stage 'warmup')" in err
    assert "(sft/entropy)" in err and "since step 2" in err and "sft.lr=1000000.0" in err
    # step 1's update already broke the weights, so even the first checkpoint is not good
    assert "No checkpoint from before step 1 is left" in err


@pytest.fixture
def infinite_grad_norm(monkeypatch):
    """Every optimizer step sees a non-finite gradient norm, as after an overflow: the strategy skips it."""
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: torch.tensor(math.inf))


@pytest.mark.slow  # a few warm-up steps (~5 s)
def test_consecutive_skipped_steps_stop_the_run(tmp_path, capsys, infinite_grad_norm):
    rc, _ = run("grpo", tmp_path, "sft.steps=20", "guard.max_skipped_steps=3")
    err = capsys.readouterr().err
    assert rc == EXIT_DIVERGED, err[-3000:]
    assert "training diverged at step 3 (step 3 of stage 'warmup'): 3 steps in a row trained nothing " \
           "(since step 1): every optimizer step of the policy skipped for a non-finite gradient norm " \
           "(grad_norm=inf)" in err
    assert "No good checkpoint" in err and "guard.max_skipped_steps" in err


@pytest.mark.slow  # two warm-up steps (~4 s)
def test_a_stage_with_every_step_skipped_stops_even_when_shorter_than_the_limit(tmp_path, capsys,
                                                                                infinite_grad_norm):
    rc, _ = run("grpo", tmp_path, "sft.steps=2", "trainer.total_steps=2")
    err = capsys.readouterr().err
    assert rc == EXIT_DIVERGED, err[-3000:]
    assert "training diverged at step 2 (step 2 of stage 'warmup'): the stage ended and none of its 2 step(s) " \
           "applied an update" in err


@pytest.mark.slow  # a few warm-up steps (~5 s)
def test_nonfinite_weights_stop_the_run_before_a_checkpoint_holds_them(tmp_path, capsys, monkeypatch):
    original = AccelerateStrategy.step

    def step_then_poison(self):
        info = original(self)
        if self.optimizer_steps == 3:  # e.g. an fp16 weight overflowing: the gradients stay finite
            with torch.no_grad():
                next(self.unwrap().parameters()).view(-1)[0] = math.nan
        return info

    monkeypatch.setattr(AccelerateStrategy, "step", step_then_poison)
    rc, run_dir = run("grpo", tmp_path, "sft.steps=10", "checkpoint.every=2", "guard.check_weights_every=0")
    err = capsys.readouterr().err
    assert rc == EXIT_DIVERGED, err[-3000:]
    assert "training diverged at step 4 (step 4 of stage 'warmup'): the policy's weights are not finite " \
           "(model.embed_tokens.weight is the first parameter holding nan or inf)" in err
    assert f"Last good checkpoint: {run_dir}/checkpoints/step_000002 " in err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000002"]
