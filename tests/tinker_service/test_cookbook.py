"""tinker-cookbook 0.6.1's own RL loop (``tinker_cookbook.rl.train.main``) against a real
``rltk serve-tinker``: two steps on the cookbook's arithmetic environment over the tiny default.

The cookbook runs in a child process configured as a user on another machine would be: the SDK's
``TINKER_BASE_URL`` / ``TINKER_API_KEY``, and ``HF_ENDPOINT`` / ``HF_TOKEN`` for the tokenizer the
service serves (the cookbook's ``get_tokenizer("tiny")``); its own Hub cache, no access to the
server's folders. Installed as the docs say, ``pip install --no-deps tinker-cookbook==0.6.1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tinker")
pytest.importorskip("fastapi")
pytest.importorskip("tinker_cookbook")

from tests.tinker_service.test_app import _benchmark  # noqa: E402
from tests.waits import scaled

pytestmark = pytest.mark.slow
KEY = "tml-cookbook"
STEPS = 2

COOKBOOK_RUN = textwrap.dedent("""
    import asyncio, sys
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    dataset = ArithmeticDatasetBuilder(batch_size=2, group_size=2, n_batches=int(sys.argv[2]),
                                       model_name_for_tokenizer="tiny", renderer_name="role_colon",
                                       include_fewshot=False)
    config = train.Config(learning_rate=1e-3, dataset_builder=dataset, model_name="tiny",
                          recipe_name="rltk_test", max_tokens=8, log_path=sys.argv[1], lora_rank=4,
                          eval_every=0, save_every=0)
    asyncio.run(train.main(config))
""")


def test_the_cookbooks_rl_train_main_runs_against_the_service(tmp_path):
    proc, url = _benchmark().start_server("--api-key", KEY, "--threads", "1")
    try:
        env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": KEY, "HF_ENDPOINT": f"{url}/hub",
               "HF_TOKEN": KEY, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
               "TINKER_TELEMETRY": "0", "WANDB_MODE": "disabled"}
        log = tmp_path / "run"
        out = subprocess.run([sys.executable, "-c", COOKBOOK_RUN, str(log), str(STEPS)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=scaled(900))
        assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    finally:
        proc.terminate()
        proc.wait(scaled(30))
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [row for row in rows if "optim/lr" in row]  # the cookbook's training steps (a last row follows)
    assert [row["step"] for row in trained] == list(range(STEPS)), rows
    for row in trained:
        assert any(k.startswith("env/all/reward") for k in row), sorted(row)
        assert row["progress/batch"] == row["step"]
