"""`rltk run reward_model`: a Bradley-Terry reward model trained from preference pairs (issue 32, item 3)."""

import json
from pathlib import Path

import pytest
import torch

from rltk.commands.cli import main
from rltk.config.loader import load_config
from rltk.training.updates.reward_model import build_reward_model, pair_rewards, preference_pairs, tokenize_pairs

CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "reward_model.yaml"

FEW = ["stages=[]", "reward_model.steps=3", "reward_model.warmup_steps=0", "reward_model.eval_every=3",
       "reward_model.batch_size=4", "data.train_size=16", "data.eval_size=4", "logging.logger=[jsonl]"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short run from the fresh tiny model (no SFT stage): 30 steps, enough to move the head off zero.

    Not a learning claim: tests/recipes/test_reward_model_learning.py runs the shipped default.
    """
    run_dir = tmp_path_factory.mktemp("rm") / "run"
    assert main(["run", "reward_model", f"output_dir={run_dir}", *FEW, "reward_model.steps=30",
                 "reward_model.eval_every=30", "reward_model.batch_size=8", "data.train_size=200",
                 "data.eval_size=50"]) == 0
    return run_dir


def test_the_run_reports_pairwise_accuracy_from_chance(trained):
    evals = [m for m in read_metrics(trained) if "eval/pairwise_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 30]
    assert evals[0]["eval/pairwise_accuracy"] == 0.5 and evals[0]["eval/margin"] == 0.0  # the zero head ties
    assert evals[1]["eval/margin"] != 0.0  # the head has trained


def test_the_saved_folder_is_a_standard_sequence_classifier(trained):
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    folder = trained / "reward_model"
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    assert model.config.num_labels == 1 and type(model).__name__ == "Qwen2ForSequenceClassification"
    # Reload -> the same held-out accuracy the run reported last.
    cfg = load_config([CONFIG], ["stages=[]", "data.train_size=200", "data.eval_size=50"])
    from rltk.training.scaffold.rows import build_rows

    _, held_out = build_rows(cfg, tokenizer)
    pairs = tokenize_pairs(preference_pairs(held_out, cfg, split="heldout"), tokenizer, cfg.reward_model.max_length)
    with torch.no_grad():
        chosen, rejected = pair_rewards(model, pairs, tokenizer.pad_token_id, "cpu")
    accuracy = ((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).mean().item()
    last = [m for m in read_metrics(trained) if "eval/pairwise_accuracy" in m][-1]
    assert accuracy == pytest.approx(last["eval/pairwise_accuracy"])


def test_the_reward_model_reward_function_scores_with_it(trained):
    # The folder is what `reward.reward_fn_args.reward_model.path` loads (rltk/rewards/judges/reward_model.py).
    from rltk.rewards.judges import reward_model

    scorer = reward_model.load_scorer(str(trained / "reward_model"))
    cfg = load_config([CONFIG], ["stages=[]", "data.train_size=200", "data.eval_size=50"])
    from rltk.training.scaffold.rows import build_rows

    _, held_out = build_rows(cfg, scorer.tokenizer)
    pairs = preference_pairs(held_out, cfg, split="heldout")
    right = scorer.score([p for p, _, _ in pairs], [c for _, c, _ in pairs])
    wrong = scorer.score([p for p, _, _ in pairs], [r for _, _, r in pairs])
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(right, wrong)) / len(pairs)
    last = [m for m in read_metrics(trained) if "eval/pairwise_accuracy" in m][-1]
    assert wins == pytest.approx(last["eval/pairwise_accuracy"])  # it reads the texts as training did


def test_synthetic_pairs_are_a_right_answer_against_a_near_miss():
    cfg = load_config([CONFIG], ["reward_model.wrong_length=0"])  # near misses alone
    rows = [{"prompt": "12+30=", "ground_truth": "42"}, {"prompt": "0+0=", "ground_truth": "0"}] * 50
    pairs = preference_pairs(rows, cfg, split="train")
    assert pairs == preference_pairs(rows, cfg, split="train")  # seeded
    for (prompt, chosen, rejected), row in zip(pairs, rows):
        assert prompt == row["prompt"] and chosen == row["ground_truth"]
        assert rejected != chosen and 0 <= int(rejected) and abs(int(rejected) - int(chosen)) <= 20
    assert len({r for _, c, r in pairs if c == "42"}) > 10  # near misses of every size, not one



def test_wrong_length_pairs_drop_or_add_one_digit():
    cfg = load_config([CONFIG], ["reward_model.wrong_length=0.5"])
    rows = [{"prompt": "60+65=", "ground_truth": "125"}, {"prompt": "1+2=", "ground_truth": "3"}] * 100
    pairs = preference_pairs(rows, cfg, split="train")
    by_length = [(c, r) for _, c, r in pairs if len(r) != len(c)]
    # about half of 125's 100 rejected answers (its near misses 105..145 all have 3 digits; 3's can have 2)
    assert 35 < len([c for c, _ in by_length if c == "125"]) < 65
    for chosen, rejected in by_length:
        assert abs(len(rejected) - len(chosen)) == 1 and rejected != chosen
        if len(rejected) < len(chosen):  # a dropped digit: the others in order
            assert any(chosen[:i] + chosen[i + 1:] == rejected for i in range(len(chosen)))
    assert {len(r) for c, r in by_length if c == "125"} == {2, 4} and {len(r) for c, r in by_length if c == "3"} == {2}
    with pytest.raises(Exception, match="reward_model.wrong_length"):
        load_config([CONFIG], ["reward_model.wrong_length=1.5"])

def test_the_reward_model_starts_from_the_policy_backbone_with_a_zero_head():
    from rltk.models.tiny import build_tiny_from_config

    cfg = load_config([CONFIG], [])
    tokenizer, policy = build_tiny_from_config(cfg.model.tiny, 0)
    model = build_reward_model(cfg, policy)
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.config.num_labels == 1
    for name, value in policy.model.state_dict().items():
        assert torch.equal(model.model.state_dict()[name], value), name
    pairs = tokenize_pairs([("1+1=", "2", "3")], tokenizer, 64)
    chosen, rejected = pair_rewards(model, pairs, tokenizer.pad_token_id, "cpu")
    assert chosen.tolist() == [0.0] and rejected.tolist() == [0.0]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pairs_from_a_dataset_with_named_columns(tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", [
        {"question": f"{a}+1=", "good": str(a + 1), "bad": str(a + 2)} for a in range(20)])
    run_dir = tmp_path / "run"
    assert main(["run", "reward_model", f"output_dir={run_dir}", f"data.path={data}", "data.task=null",
                 "data.prompt_key=question", "data.answer_key=null", "reward_model.chosen_key=good",
                 "reward_model.rejected_key=bad", *FEW]) == 0
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if "eval/pairwise_accuracy" in m] == [0, 3]
    assert all(0 < m["rm/loss"] < 1 for m in metrics if "rm/loss" in m)
    assert (run_dir / "reward_model" / "config.json").is_file()
    assert (run_dir / "reward_model" / "tokenizer.json").is_file()


def test_a_missing_pair_column_names_the_key(tmp_path, capsys):
    data = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": f"{a}+1=", "chosen": str(a + 1)} for a in range(20)])
    assert main(["run", "reward_model", f"output_dir={tmp_path / 'run'}", f"data.path={data}", "data.task=null",
                 "data.answer_key=null", *FEW]) == 2
    assert "reward_model.rejected_key='rejected' is not a column" in capsys.readouterr().err


def test_lora_and_rl_stages_are_refused_with_exit_2(tmp_path, capsys):
    assert main(["run", "reward_model", f"output_dir={tmp_path / 'a'}", *FEW, "model.lora.r=4"]) == 2
    assert "'model.lora'" in capsys.readouterr().err
    assert main(["run", "reward_model", f"output_dir={tmp_path / 'b'}", *FEW[1:],
                 "stages=[{name: grpo, type: rl}]"]) == 2
    # rl is no stage of this recipe's (it has no RL loop): refused naming the key, before the run starts
    assert "bad value 'rl' for 'stages[0].type' (stage 'grpo')" in capsys.readouterr().err
    # a registered RL stage passes validation, and the recipe refuses it: only sft stages come before the model
    assert main(["run", "reward_model", f"output_dir={tmp_path / 'c'}", *FEW[1:],
                 "stages=[{name: rl, type: grpo}]"]) == 2
    assert "'stages[0]' ('rl') has type grpo: only sft stages can come before the reward model" in \
        capsys.readouterr().err


def test_an_unknown_loss_is_refused_with_the_registered_names(tmp_path, capsys):
    assert main(["run", "reward_model", f"output_dir={tmp_path / 'a'}", *FEW, "reward_model.loss=bradly_terry"]) == 2
    err = capsys.readouterr().err
    assert "reward_model.loss" in err and "bradley_terry" in err
