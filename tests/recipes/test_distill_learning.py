"""`rltk run distill` learns from its teacher on the embedded default (issue 32, item 4).

The shipped default as `python benchmarks/learning.py --recipes distill` measures it: the teacher is `rltk run
sft` (the shipped default, seed 0) built at the test's own kernel level, the student the distill default (a
tiny model of hidden 48 given 500 steps of SFT of its own, then 1000 distillation steps), seed 0. The test asks
for half the smallest held-out greedy and sampled gains of the distillation stage and half the smallest drop
of the student's reverse KL to its teacher that the benchmark measured over seeds 0-4 and every kernel level, and a
rising teacher log-prob. About 35 s of teacher SFT and 100 s of the run on a quiet 2-core machine.
"""

import json
import statistics
from pathlib import Path

import pytest

from rltk.commands.cli import main

# python benchmarks/learning.py --recipes distill --jobs 2 (docs/measurements.md; 15 runs): the smallest,
# over seeds 0-4 and the kernel levels default / avx2 / avx512, of the held-out greedy and sampled accuracy
# gains (the last evaluation against the first one of the distillation stage; seed 0's smallest greedy gain,
# +0.020, is at avx2) and of the reverse-KL drop (mean of the first 25 distillation steps minus mean of the
# last 25). The test asks for half of each.
MIN_BENCHMARK_GREEDY_GAIN = 0.020
MIN_BENCHMARK_SAMPLED_GAIN = 0.025
MIN_BENCHMARK_KL_DROP = 0.279
WINDOW = 25
QUIET = ["logging.logger=[jsonl]", "logging.plot=false", "logging.traces=false"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_default_student_learns_the_sums_from_its_teacher(tmp_path):
    teacher_run = tmp_path / "teacher"
    assert main(["run", "sft", "seed=0", f"output_dir={teacher_run}", *QUIET]) == 0
    teacher = sorted((teacher_run / "checkpoints").glob("step_*"))[-1]
    run_dir = tmp_path / "student"
    assert main(["run", "distill", "seed=0", f"distill.teacher_path={teacher}", f"output_dir={run_dir}",
                 *QUIET]) == 0
    metrics = read_metrics(run_dir)
    # the warm-up stage evaluates nothing: the first evaluation is the distillation stage's, before its first step
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert evals[0]["step"] == 500 and evals[-1]["step"] == 1500
    curve = [(m["step"], m["eval/accuracy"], m["eval/sampled_accuracy"]) for m in evals]
    assert evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"] > MIN_BENCHMARK_GREEDY_GAIN / 2, curve
    assert evals[-1]["eval/sampled_accuracy"] - evals[0]["eval/sampled_accuracy"] > MIN_BENCHMARK_SAMPLED_GAIN / 2, curve

    steps = [m for m in metrics if "distill/reverse_kl" in m]
    first, last = steps[:WINDOW], steps[-WINDOW:]
    kl_drop = statistics.mean(r["distill/reverse_kl"] for r in first) - statistics.mean(
        r["distill/reverse_kl"] for r in last)
    assert kl_drop > MIN_BENCHMARK_KL_DROP / 2, kl_drop
    # the teacher rates the student's samples higher at the end than at the start
    assert statistics.mean(r["distill/teacher_logprob"] for r in last) > statistics.mean(
        r["distill/teacher_logprob"] for r in first)
