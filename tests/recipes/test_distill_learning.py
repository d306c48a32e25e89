"""`rltk run distill` learns from its teacher on the embedded default (issue 32, item 4).

The shipped default as benchmarks/distill.py measures it with `--student-hidden 32 --student-sft-steps 0`: the
teacher is `rltk run sft` (the shipped default, seed 0), the student the shipped distill default (a fresh tiny
model of hidden size 32), seed 0. The test
asks for half the smallest reverse-KL drop the benchmark measured over its seeds (seed 0 reproduces the
benchmark's 5.829 -> 2.955 here, bit for bit) and a rising teacher log-prob. Held-out accuracy is not
asserted: from a fresh student it moves by at most two of 200 sums in 300 steps, and from a student given an
SFT warm-up of its own it rose no faster than GRPO's over seeds and kernel levels (README). About 35 s of
teacher SFT and 300 distillation steps: ~1 min on a quiet 2-core machine, 108 s under a load of 15.
"""

import json
import statistics
from pathlib import Path

import pytest

from rltk.cli import main

# python benchmarks/distill.py --student-hidden 32 --student-sft-steps 0 --steps 300 --levels avx512 (README,
# "On-policy distillation"): the smallest
# drop, over the seeds, of the student's reverse KL to the teacher on its own samples (mean of the first 25
# steps minus mean of the last 25). The test asks for half.
MIN_BENCHMARK_KL_DROP = 2.874
WINDOW = 25
QUIET = ["logging.logger=[jsonl]", "logging.plot=false", "logging.traces=false"]


def step_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "distill/reverse_kl" in r]


@pytest.mark.slow
def test_a_fresh_student_moves_toward_its_teacher(tmp_path):
    teacher_run = tmp_path / "teacher"
    assert main(["run", "sft", "seed=0", f"output_dir={teacher_run}", *QUIET]) == 0
    teacher = sorted((teacher_run / "checkpoints").glob("step_*"))[-1]
    run_dir = tmp_path / "student"
    assert main(["run", "distill", "seed=0", f"distill.teacher_path={teacher}", f"output_dir={run_dir}", *QUIET,
                 # no held-out evaluations (they draw on their own stream, trainer.eval_seed: the training
                 # trajectory is the benchmark's)
                 "checkpoint.every=0", "trainer.eval_every=0"]) == 0
    steps = step_rows(run_dir)
    first, last = steps[:WINDOW], steps[-WINDOW:]
    kl_drop = statistics.mean(r["distill/reverse_kl"] for r in first) - statistics.mean(
        r["distill/reverse_kl"] for r in last)
    assert kl_drop > MIN_BENCHMARK_KL_DROP / 2, kl_drop
    # the teacher rates the student's samples higher at the end than at the start
    assert statistics.mean(r["distill/teacher_logprob"] for r in last) > statistics.mean(
        r["distill/teacher_logprob"] for r in first)
