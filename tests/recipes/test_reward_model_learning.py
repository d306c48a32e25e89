"""The reward model learns on the embedded default (issue 32, item 3).

`rltk run rm` exactly as shipped (1500 SFT steps, then 2000 Bradley-Terry steps): held-out pairwise
accuracy must rise, on the default's pairs and on near misses alone. GRPO against the learned model
(issue 31, item 5) is not asserted: in benchmarks/rm_then_grpo.py it lowered held-out exact match
(docs/measurements.md).
"""

import json
from pathlib import Path

import pytest
import torch

from rltk.commands.cli import main
from rltk.config.loader import load_config
from rltk.training.updates.reward_model import pair_rewards, preference_pairs, tokenize_pairs
from rltk.training.scaffold.rows import build_rows

CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "reward_model.yaml"

# benchmarks/learning.py --recipes reward_model --seeds 0 1 2 (every CPU kernel level; docs/measurements.md):
# the shipped default's smallest held-out pairwise-accuracy gain over those 9 runs. The test
# asks for half.
MIN_PAIRWISE_GAIN = 0.415
# The same 9 reward models on held-out near misses alone (no wrong-length pairs): the smallest gain (0.895).
MIN_NEAR_MISS_GAIN = 0.395

QUIET = ["logging.logger=[jsonl]", "logging.plot=false"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rm") / "run"
    assert main(["run", "rm", f"output_dir={run_dir}", *QUIET]) == 0  # the shipped default, by its short name
    return run_dir


def near_miss_accuracy(folder: Path) -> float:
    """Held-out pairwise accuracy of a saved reward model on near misses alone (``wrong_length=0``): the
    hard pairs, which a model could fail while the easy wrong-length pairs carry the run's figure."""
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    cfg = load_config([CONFIG], ["reward_model.wrong_length=0"])
    _, held_out = build_rows(cfg, tokenizer)
    pairs = tokenize_pairs(preference_pairs(held_out, cfg, split="heldout"), tokenizer, cfg.reward_model.max_length)
    with torch.no_grad():
        chosen, rejected = pair_rewards(model, pairs, tokenizer.pad_token_id, "cpu")
    return ((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).mean().item()


@pytest.mark.slow
def test_the_default_reward_model_learns(rm_run):
    evals = [m for m in read_metrics(rm_run) if "eval/pairwise_accuracy" in m]
    assert [m["step"] - evals[0]["step"] for m in evals] == [0, 500, 1000, 1500, 2000]
    assert evals[0]["eval/pairwise_accuracy"] == 0.5  # the zero head ties every pair
    assert evals[-1]["eval/pairwise_accuracy"] > 0.5 + MIN_PAIRWISE_GAIN / 2, evals
    assert near_miss_accuracy(rm_run / "reward_model") > 0.5 + MIN_NEAR_MISS_GAIN / 2
