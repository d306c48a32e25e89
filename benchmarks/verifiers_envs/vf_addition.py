"""A verifiers environment for the learning benchmark: two-digit addition, scored by a rubric.

Written against the classic verifiers API like any Environments Hub module (`load_environment` returning a
`SingleTurnEnv`); benchmarks/learning.py puts this folder on PYTHONPATH, so `env_id=vf_addition` imports it.
The rubric has two reward functions, so the `gdpo` advantage has two columns: the exact answer (weight 1) and
an answer that is a number at all (weight 0.2).
"""

import random

import verifiers.legacy as vf
from datasets import Dataset


def exact_answer(completion, answer) -> float:
    return float(completion[-1].content.strip() == answer)


def is_number(completion) -> float:
    return float(completion[-1].content.strip().isdigit())


def load_environment(size: int = 2000, seed: int = 0):
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b)})
    rubric = vf.Rubric(funcs=[exact_answer, is_number], weights=[1.0, 0.2])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=rubric)
