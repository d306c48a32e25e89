"""Console progress: which steps print, the exact line, sticky values, throughput, ETA, terminal bar."""

from __future__ import annotations

import io

import pytest
import torch

from rltk.loggers.console import ConsoleLogger, format_count, format_duration


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(total_steps=5, **kwargs):
    stream, clock = io.StringIO(), FakeClock()
    logger = ConsoleLogger(run_dir=None, config={}, total_steps=total_steps, stream=stream, clock=clock,
                           **{"tty": False, **kwargs})
    return logger, stream, clock


def test_line_mode_prints_first_every_nth_and_last_step():
    logger, stream, clock = make(total_steps=5, every=2)
    for step in range(1, 6):
        clock.now = 2.0 * step
        logger.log({"reward": 0.1 * step}, step)
    printed = [line.split(" |")[0] for line in stream.getvalue().splitlines()]
    assert printed == ["step 1/5 (20%)", "step 2/5 (40%)", "step 4/5 (80%)", "step 5/5 (100%)"]


def test_line_shows_the_watched_metrics_rate_and_eta():
    logger, stream, clock = make(total_steps=5, every=1)
    clock.now = 2.0
    logger.log({"reward": 0.4375, "kl": 0.00123456, "entropy": 1.5, "loss": 9.0}, 1)
    # 2 s for 1 step -> 2 s/step, 4 steps left -> 8 s; unlisted metrics (loss) are not shown
    assert stream.getvalue() == ("step 1/5 (20%) | train reward 0.4375 | kl 0.001235 | entropy 1.5 | 2.00s/step | "
                                 "ETA 8s\n")


def test_evaluation_accuracy_sticks_until_the_next_evaluation():
    logger, stream, clock = make(total_steps=4, every=1)
    logger.log({"reward": 1.0}, 1)
    logger.log({"eval/accuracy": 0.25}, 1)  # same step: remembered, not printed twice
    logger.log({"reward": 2.0}, 2)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert "held-out" not in lines[0] and "train reward 2 | held-out greedy 0.25" in lines[1]


def test_tokens_per_second_from_token_counts_over_wall_time():
    logger, stream, clock = make(total_steps=10, every=2)
    for step in range(1, 5):
        clock.now = 0.5 * step
        logger.log({"tokens": 1000}, step)
    lines = stream.getvalue().splitlines()
    # step 1: 1000 tokens in 0.5 s; steps 2: 1000 in 0.5 s; steps 3-4: 2000 tokens in 1.0 s
    assert [line.split(" | ")[1] for line in lines] == ["tok/s 2.0k", "tok/s 2.0k", "tok/s 2.0k"]


def test_reported_tokens_per_second_wins_and_tensors_are_accepted():
    logger, stream, clock = make(total_steps=2, every=1)
    clock.now = 1.0
    logger.log({"tokens_per_s": torch.tensor(2_500_000.0), "reward": torch.tensor([0.5])}, 1)
    assert "reward 0.5 | tok/s 2.5M" in stream.getvalue()


def test_eta_after_resume_counts_only_steps_run_here():
    logger, stream, clock = make(total_steps=20, every=1, resume_step=10)
    clock.now = 3.0
    logger.log({}, 11)
    assert stream.getvalue() == "step 11/20 (55%) | 3.00s/step | ETA 27s\n"


def test_terminal_mode_redraws_one_line_and_close_ends_it():
    logger, stream, clock = make(total_steps=4, tty=True, bar_width=8)
    clock.now = 1.0
    logger.log({"reward": 1.0}, 1)
    clock.now = 2.0
    logger.log({"reward": 0.5}, 2)
    logger.close()
    out = stream.getvalue()
    assert out.count("\r") == 2 and out.endswith("\x1b[K\n")
    assert "\r[####....] step 2/4 (50%) | train reward 0.5 | 1.00s/step | ETA 2s\x1b[K" in out


def test_custom_fields():
    logger, stream, _ = make(total_steps=1, fields={"pass@1": "eval/pass1", "r": ["score", "reward"]})
    logger.log({"reward": 3.0, "eval/pass1": 0.5}, 1)
    assert stream.getvalue().startswith("step 1/1 (100%) | pass@1 0.5 | r 3 |")


def test_bad_values_and_arguments_are_named():
    logger, _, _ = make()
    with pytest.raises(TypeError, match="metric 'note' has value 'hi' of type str"):
        logger.log({"note": "hi"}, 1)
    with pytest.raises(ValueError, match="every=0 must be an integer >= 1"):
        make(every=0)
    with pytest.raises(ValueError, match="total_steps=-1 must be an integer >= 0"):
        make(total_steps=-1)


def test_a_run_with_no_training_steps_prints_its_evaluation():
    logger, stream, _ = make(total_steps=0, fields={"pass@1": "eval/pass1"})
    logger.log({"eval/pass1": 0.25}, 0)  # `stages=[]`: the evaluation of the model as it is, at step 0
    logger.close()
    assert stream.getvalue().startswith("step 0/0 (0%) | pass@1 0.25")


def test_writes_to_stderr_by_default(capsys):
    ConsoleLogger(total_steps=1, tty=False).log({"reward": 1.0}, 1)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("step 1/1 (100%) | train reward 1")


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42.4, "42s"), (185, "3m05s"), (7620, "2h07m"),
                                           (float("inf"), "?")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("value, text", [(950, "950"), (5100, "5.1k"), (2.34e6, "2.3M"), (3e9, "3.0G")])
def test_format_count(value, text):
    assert format_count(value) == text


# ---------------------------------------------------------------- stages

def staged(every=5):
    from rltk.loggers.base import stage_spans

    logger, stream, clock = make(total_steps=15, every=every)
    logger.set_stages(stage_spans([("warmup", "sft", 10), ("grpo", "rl", 5)]))
    return logger, stream, clock


def run_warmup_then_rl(logger, clock):
    for step in range(1, 11):  # supervised steps: 0.1 s each
        clock.now = 0.1 * step
        logger.log({"sft/sft_loss": 1.0 / step, "sft/lr": 1e-3}, step)
    clock.now = 4.0  # 3 s of evaluation before the first RL step, logged at the warm-up's last step
    logger.log({"eval/accuracy": 0.52, "eval/sampled_accuracy": 0.31}, 10)
    for step in range(11, 16):  # RL steps: 2 s each
        clock.now = 4.0 + 2.0 * (step - 10)
        logger.log({"reward": 0.4, "accuracy": 0.3, "kl": 0.001}, step)


def test_eta_is_the_current_stages_own_and_later_stages_are_unknown():
    logger, stream, clock = staged()
    run_warmup_then_rl(logger, clock)
    lines = stream.getvalue().splitlines()
    # first and last step of each stage, and every 5th
    assert [line.split(" |")[0] for line in lines] == [
        "[warmup 1/10] step 1/15 (7%)", "[warmup 5/10] step 5/15 (33%)", "[warmup 10/10] step 10/15 (67%)",
        "[grpo 1/5] step 11/15 (73%)", "[grpo 5/5] step 15/15 (100%)"]
    # 0.1 s per warm-up step, 5 steps left; the RL stage has not been timed, so no number is made up
    assert lines[1] == "[warmup 5/10] step 5/15 (33%) | sft loss 0.2 | 0.10s/step | warmup ETA 0s, then grpo ?"
    # RL: 2 s per step from its own steps (the warm-up's 0.1 s and the evaluation do not count),
    # 4 steps left -> 8 s; the warm-up loss is gone, held-out stays apart from the training numbers
    assert lines[3] == ("[grpo 1/5] step 11/15 (73%) | train reward 0.4 acc 0.3 | held-out greedy 0.52 sampled 0.31 "
                        "| kl 0.001 | 2.00s/step | ETA 8s")


def test_averaging_both_stages_would_have_been_far_off():
    # The bug this guards against: one mean over 0.1 s and 2 s steps said 5 steps x ~0.45 s.
    logger, stream, clock = staged(every=1)
    run_warmup_then_rl(logger, clock)
    first_rl = next(line for line in stream.getvalue().splitlines() if line.startswith("[grpo 1/5]"))
    assert first_rl.endswith("| 2.00s/step | ETA 8s")


def test_a_run_resumed_in_its_last_stage_times_only_its_own_steps():
    from rltk.loggers.base import stage_spans

    logger, stream, clock = make(total_steps=15, every=1, resume_step=12)
    logger.set_stages(stage_spans([("warmup", "sft", 10), ("grpo", "rl", 5)]))
    clock.now = 3.0
    logger.log({"reward": 0.5}, 13)
    assert stream.getvalue() == "[grpo 3/5] step 13/15 (87%) | train reward 0.5 | 3.00s/step | ETA 6s\n"


def test_a_single_stage_is_named_without_a_second_counter():
    from rltk.loggers.base import stage_spans

    logger, stream, clock = make(total_steps=4, every=1)
    logger.set_stages(stage_spans([("grpo", "rl", 4)]))
    logger.log({"eval/accuracy": 0.5}, 0)  # the opening evaluation: its time is not a step's
    clock.now = 10.0
    logger.log({"eval/accuracy": 0.5}, 0)
    clock.now = 11.0
    logger.log({"reward": 1.0}, 1)
    assert stream.getvalue().splitlines()[-1] == ("[grpo] step 1/4 (25%) | train reward 1 | held-out greedy 0.5 "
                                                 "| 1.00s/step | ETA 3s")


def test_the_warm_up_probe_shows_the_truncated_fraction_beside_its_accuracy():
    # a probe at accuracy 0 because every episode hits the per-turn cap must say so on the line
    logger, stream, clock = staged()
    clock.now = 0.1
    logger.log({"sft/sft_loss": 0.02, "sft/train_accuracy": 0.0, "sft/probe_truncated_fraction": 1.0}, 1)
    assert stream.getvalue().splitlines()[0].startswith(
        "[warmup 1/10] step 1/15 (7%) | sft loss 0.02 probe acc 0 truncated 1 |")


def test_a_warm_up_that_may_stop_early_shows_its_cap_and_the_rl_stage_counts_its_own_steps():
    # sft.steps=6000 with sft.stop_at_accuracy: a cap. The warm-up stops at its probe of step 2; the RL stage's
    # opening evaluation is logged at global step 6000, and its steps are 6001.. (the cap stays reserved)
    from rltk.loggers.base import stage_spans

    logger, stream, clock = make(total_steps=6200, every=10)
    logger.set_stages(stage_spans([("warmup", "sft", 6000, True), ("grpo", "rl", 200)]))
    for step in (1, 2):  # 0.1 s a step
        clock.now = 0.1 * step
        logger.log({"sft/sft_loss": 0.5 / step, "sft/train_accuracy": 0.45}, step)
    clock.now = 5.0  # 4.8 s of evaluation before the first RL step
    logger.log({"eval/accuracy": 0.52}, 6000)
    for step in (6001, 6002):  # 2 s a step
        clock.now = 5.0 + 2.0 * (step - 6000)
        logger.log({"reward": 0.4}, step)
    lines = stream.getvalue().splitlines()
    # the warm-up's time to its cap is an upper bound (5999 steps left x 0.1 s), not an ETA
    assert lines[0] == ("[warmup 1, up to 6000] | sft loss 0.5 probe acc 0.45 | 0.10s/step | "
                        "warmup at most 10m00s, then grpo ?")
    # no line for step 6000, which the warm-up never ran; RL counts its own steps: 1 of 200, not 6001 of 6200
    assert lines[1] == "[grpo 1/200] (0%) | train reward 0.4 | held-out greedy 0.52 | 2.00s/step | ETA 6m38s"
    assert len(lines) == 2  # steps 2 and 6002 are neither a stage's first or last nor a multiple of every=10


def test_a_warm_up_that_stopped_early_hands_the_run_its_real_length():
    # what the recipes do: the warm-up (cap 6000) stops at its probe of step 2, the run gives the loggers the
    # spans again, and the RL stage's steps follow it: 3, 4 ... of a run that now ends at 202
    from rltk.loggers.base import stage_ended, stage_spans

    logger, stream, clock = make(total_steps=6200, every=10)
    spans = stage_spans([("warmup", "sft", 6000, True), ("grpo", "rl", 200)])
    logger.set_stages(spans)
    for step in (1, 2):  # 0.1 s a step
        clock.now = 0.1 * step
        logger.log({"sft/sft_loss": 0.5 / step}, step)
    logger.set_stages(stage_ended(spans, 0, 2))
    clock.now = 5.0  # 4.8 s of evaluation before the first RL step, logged at the warm-up's last step
    logger.log({"eval/accuracy": 0.52}, 2)
    for step in (3, 4):  # 2 s a step
        clock.now = 5.0 + 2.0 * (step - 2)
        logger.log({"reward": 0.4}, step)
    lines = stream.getvalue().splitlines()
    assert logger.total_steps == 202
    assert lines[0].startswith("[warmup 1, up to 6000] | sft loss 0.5 |")
    # the RL stage counts its own steps and, the run's length known now, the run's: 199 left x 2 s
    assert lines[1] == "[grpo 1/200] step 3/202 (1%) | train reward 0.4 | held-out greedy 0.52 | 2.00s/step | ETA 6m38s"
    assert len(lines) == 2


def test_the_bar_of_a_run_with_a_capped_warm_up_fills_with_the_stage():
    from rltk.loggers.base import stage_spans

    logger, stream, clock = make(total_steps=120, tty=True, bar_width=10)
    logger.set_stages(stage_spans([("warmup", "sft", 100, True), ("grpo", "rl", 20)]))
    logger.log({"sft/sft_loss": 0.5}, 1)
    logger.log({"eval/accuracy": 0.5}, 100)
    logger.log({"reward": 0.4}, 110)
    assert stream.getvalue().rsplit("\r", 1)[-1].startswith("[#####.....] [grpo 10/20] (50%)")
