"""`rltk run grpo` with the `code_execution` reward: a real run scores hostile programs and carries on.

The tiny model writes no Python, so the programs come in as expert responses
(`buffer.expert.path`, mixed into the batches by `mix_expert`): the run's own
composer scores each in its worker processes when the run starts, like any
sample. The run must finish (exit 0) with no reward failure or composer
timeout, hostile programs must score 0 (their per-reason counts are checked in
tests/rewards/test_code_execution.py), the policy's samples must be scored
through the sandbox at every step, and the escape file must not exist.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from rltk.commands.cli import main
from tests.waits import scaled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0,
                       reason="the sandbox needs Linux and root (CI runs as root)"),
]

TESTS = json.dumps(["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"])


def fence(code: str) -> str:
    return f"```python\n{code}\n```"


def test_grpo_run_scores_hostile_programs_in_the_sandbox_and_finishes(tmp_path):
    escape = Path("/tmp") / f"rltk-sandbox-escape-{uuid.uuid4().hex}"
    experts = {
        "add a": fence("def add(a, b):\n    return 0 if a == 0 else a + b"),  # 2 of 3 tests pass
        "add b": fence("import os\nwhile True:\n    os.fork()"),
        "add c": fence("x = bytearray(10 * 2**30)"),
        "add d": fence("import time\ntime.sleep(3600)"),
        "add e": fence(f"open({str(escape)!r}, 'w').write('x')\nopen('/etc/passwd', 'a').write('x')"),
    }
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": TESTS, "response": r}) + "\n"
                            for p, r in experts.items()))
    run_dir = tmp_path / "run"
    args = [
        f"output_dir={run_dir}", f"data.path={data}", f"buffer.expert.path={data}",
        "buffer.sample_strategy=mix_expert", "reward.reward_fn=[code_execution]", f"reward.timeout_s={scaled(30):.0f}",
        "reward.workers=2", "reward.reward_fn_args.code_execution.timeout_s=1.5",
        "reward.reward_fn_args.code_execution.cpu_s=1", "stages=[{name: grpo, type: rl}]",
        "trainer.total_steps=2", "trainer.warmup_steps=0", "trainer.prompts_per_step=2", "rollout.n=2",
        "trainer.eval_every=0", "rollout.max_new_tokens=16", "model.tiny.hidden_size=64",
        "model.tiny.num_layers=2", "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.every=0",
    ]
    assert main(["run", "grpo", *args]) == 0

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward_fn/calls" in m]
    assert len(steps) == 2
    # The 5 expert programs and the 4 policy samples of step 1 were all scored by the sandbox: no call
    # failed the reward or overran reward.timeout_s (the sandbox stopped each program itself).
    assert steps[0]["reward_fn/calls"] >= 5 + 4
    for m in steps:
        assert m["reward/code_execution/tests"] == 3.0  # the policy's own samples ran too
        assert m["reward_fn/failures/code_execution"] == 0.0 and m["reward_fn/timeouts/code_execution"] == 0.0
    from rltk.training.scaffold.traces import read_traces

    # Expert samples trained on carry the sandbox's score: 2/3 for the one program, 0 for the hostile ones.
    expert_scores = [t["score"] for t in read_traces(run_dir / "traces.jsonl") if t["source"] != "policy"]
    assert expert_scores and set(expert_scores) <= {0.66667, 0.0} and 0.66667 in expert_scores
    assert not escape.exists()
