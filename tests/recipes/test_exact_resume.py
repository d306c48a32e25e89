"""A run killed in its RL stage and resumed logs every number the uninterrupted run logs, bit for bit,
and ends with the same weights (issue #12, item 4).

Each recipe trains a tiny model briefly, once straight through and once crashing at an RL step drawn
from a seeded generator (and, for GRPO, at the first RL step, right after the warm-up's last
checkpoint) and then resumed. Every metric row must be equal, floats compared with ``==``: a
generator seeded again instead of restored, a counter starting from 0 or a row logged twice shows
up here as an inequality. Only wall-clock timings are left out.
"""

from __future__ import annotations

import hashlib
import json
import random
import types
from pathlib import Path

import pytest

import rltk
from rltk.commands.cli import main
from rltk.data.synthetic import make_task
from tests.crash import crash_at_step

pytestmark = pytest.mark.slow

SFT_STEPS, RL_STEPS = 60, 6
TINY = [f"sft.steps={SFT_STEPS}", "sft.stop_at_accuracy=null", "sft.warmup_steps=2", "data.task_args.max_digits=1",
        "data.train_size=70", "data.eval_size=20", f"trainer.total_steps={RL_STEPS}", "trainer.warmup_steps=2",
        "trainer.prompts_per_step=4", "rollout.n=4", "trainer.eval_every=3", "logging.logger=[jsonl]",
        "logging.plot=false",
        # a checkpoint every second RL step, and only two in the warm-up (its last one is the stage boundary)
        "checkpoint.every=2",
        f"stages=[{{name: warmup, type: sft, overrides: {{checkpoint.every: {SFT_STEPS // 2}}}}}, "
        "{name: rl, type: rl}]",
        # a second reward that fails on some samples, so the failure counters have something to carry over
        "reward.reward_fn=[exact_match,odd_length_fails]", "reward.weights={odd_length_fails: 0.0}"]
GRPO = [*TINY, "trainer.mini_batches=2", "trainer.ppo_epochs=2", "trainer.micro_batch_size=4"]
VARIANTS = {  # name: (recipe, overrides)
    # two mini-batches of shuffled rows and several micro-batches per step: the shuffling generator
    # and the summation order both matter
    "grpo": ("grpo", GRPO),
    # trains on 8 of each step's 16 experiences and keeps the rest for the next step: the buffer
    # holds experiences across steps, and so across a checkpoint
    "grpo-staleness": ("grpo", [*GRPO, "buffer.sample_strategy=staleness",
                                "buffer.sample_strategy_args={max_staleness: 2, batch_size: 8}"]),
    # demonstrations mixed into every batch and recycled: the buffer's order of them is state, and
    # they are scored once when the stage starts (a resumed run must not count those calls again)
    "grpo-expert": ("grpo", [*GRPO, "buffer.sample_strategy=mix_expert",
                             "buffer.sample_strategy_args.expert_fraction=0.2"]),
    "ppo": ("ppo", [*TINY, "critic.warmup_steps=1"]),
}


def odd_length_fails(*, response: str) -> float:
    if len(response) % 2:
        raise ValueError("odd length")
    return 1.0


@pytest.fixture(autouse=True)
def flaky_reward():
    plugin = types.ModuleType("odd_length_reward")
    plugin.rltk_reward_fns = rltk.hookimpl(lambda: {"odd_length_fails": odd_length_fails})
    rltk.register_plugin(plugin, name="odd_length_reward")
    yield
    rltk.unregister_plugin("odd_length_reward")


def numbers(run_dir: Path) -> list[dict]:
    """Every logged row, without the wall-clock timings no two runs repeat."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_per_s"))} for row in rows]


def final_weights_hash(run_dir: Path) -> str:
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert last.name == f"step_{SFT_STEPS + RL_STEPS:06d}"
    return hashlib.sha256((last / "model" / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def expert_file(tmp_path_factory) -> Path:
    """A demonstration (the correct sum) for every training prompt of the runs."""
    path = tmp_path_factory.mktemp("expert") / "expert.jsonl"
    rows = make_task("arithmetic", "train", 70, 0, min_digits=1, max_digits=1, operators="+")
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["ground_truth"],
                                        "answer": r["ground_truth"]}) + "\n" for r in rows))
    return path


def arguments(variant: str, expert_file: Path) -> tuple[str, list[str]]:
    recipe, args = VARIANTS[variant]
    return recipe, [*args, f"buffer.expert.path={expert_file}"] if variant == "grpo-expert" else args


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory, expert_file):
    """The uninterrupted run of each variant, trained once for every crash point."""
    done = {}

    def get(variant: str) -> Path:
        if variant not in done:
            recipe, args = arguments(variant, expert_file)
            run_dir = tmp_path_factory.mktemp(f"straight_{variant}")
            assert main(["run", recipe, f"output_dir={run_dir}", *args]) == 0
            done[variant] = run_dir
        return done[variant]

    return get


CRASH_STEPS = {  # RL step at which the run dies
    # from step 3 on it resumes from a checkpoint inside the RL stage (the first is at RL step 2)
    "random": lambda variant: random.Random(f"exact-resume-{variant}").randint(3, RL_STEPS),
    # right after the warm-up's last checkpoint: the RL stage starts over from the stage boundary
    "first": lambda variant: 1,
}


@pytest.mark.parametrize("variant, when", [("grpo", "random"), ("grpo", "first"), ("grpo-staleness", "random"),
                                           ("grpo-expert", "random"), ("ppo", "random")])
def test_a_run_killed_in_the_rl_stage_resumes_bit_for_bit(tmp_path, straight_runs, expert_file, variant, when):
    recipe, args = arguments(variant, expert_file)
    straight = straight_runs(variant)
    rl_step = CRASH_STEPS[when](variant)
    crashing = tmp_path / "crashing"
    with crash_at_step(SFT_STEPS + rl_step):
        main(["run", recipe, f"output_dir={crashing}", *args])
    checkpoints = [int(p.name[5:]) for p in (crashing / "checkpoints").glob("step_*")]
    resume_from = max(checkpoints)
    # it died in the RL stage, past the checkpoint it resumes from
    assert resume_from == (SFT_STEPS if when == "first" else SFT_STEPS + (rl_step - 1) // 2 * 2)
    assert main(["run", recipe, f"output_dir={crashing}", *args]) == 0

    expected, resumed = numbers(straight), numbers(crashing)
    assert [r["step"] for r in resumed] == [r["step"] for r in expected], f"crash at RL step {rl_step}"
    for a, b in zip(resumed, expected):
        assert a == b, f"crash at RL step {rl_step}, step {a['step']}: " + ", ".join(
            f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k))
    assert final_weights_hash(crashing) == final_weights_hash(straight)
    summary = lambda d: json.loads((d / "summary.json").read_text())["final"]  # noqa: E731
    assert summary(crashing) == summary(straight)

    # Not a comparison of zeros: after the resume point the policy learned and the counters counted.
    after = [r for r in expected if r["step"] > resume_from and "reward" in r]
    assert after and any(r.get("pg_loss", 0.0) != 0.0 for r in after)
    assert after[-1]["reward_fn/failures/odd_length_fails"] > after[0]["reward_fn/failures/odd_length_fails"] > 0
    assert after[0]["reward_fn/calls"] > 16  # counts from the start of the run, evaluations included
    if variant == "grpo-staleness":  # experiences older than the step trained on after the resume point
        assert any(r["buffer/staleness_max"] > 0 for r in after)
    if variant == "grpo-expert":
        assert all(r["buffer/expert"] > 0 for r in after)
