"""`rltk run distill`: on-policy distillation from a teacher's per-token log-probs (issue 32, item 4).

The fast tests run two steps against a real teacher (an `rltk run sft` checkpoint, or a saved HF folder)
and check the refusals; the learning test is in test_distill_learning.py.
"""

import json
from pathlib import Path

import pytest

from rltk.commands.cli import main
from rltk.models.tiny import build_char_tokenizer, build_tiny_model, save_pretrained_dir

# the default's two stages, the student's SFT warm-up and distillation, for two steps each
FEW = ["sft.steps=2", "sft.warmup_steps=0", "trainer.total_steps=2", "trainer.warmup_steps=0", "trainer.prompts_per_step=2", "rollout.n=2",
       "trainer.eval_every=2", "data.train_size=20", "data.eval_size=4", "logging.logger=[jsonl]",
       "logging.plot=false", "checkpoint.every=0"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def hf_teacher(folder: Path, *, tool_role: bool = False) -> Path:
    tokenizer = build_char_tokenizer(tool_role=tool_role)
    save_pretrained_dir(build_tiny_model(tokenizer, seed=7), tokenizer, folder)
    return folder


def test_two_steps_from_an_sft_checkpoint_teacher(tmp_path):
    # The teacher: 2 steps of `rltk run sft` (hidden 64), passed as its checkpoint folder; the student is the
    # distill default's smaller tiny model, after 2 steps of its own warm-up stage.
    teacher_run = tmp_path / "teacher"
    assert main(["run", "sft", f"output_dir={teacher_run}", "sft.steps=2", "sft.warmup_steps=0",
                 "sft.eval_every=null", "data.train_size=20", "data.eval_size=4", "logging.logger=[jsonl]",
                 "logging.plot=false", "checkpoint.every=2"]) == 0
    checkpoint = teacher_run / "checkpoints" / "step_000002"
    run_dir = tmp_path / "student"
    assert main(["run", "distill", f"output_dir={run_dir}", f"distill.teacher_path={checkpoint}", *FEW]) == 0
    steps = [m for m in read_metrics(run_dir) if "distill/reverse_kl" in m]
    assert [m["step"] for m in steps] == [3, 4]  # after the warm-up's steps 1 and 2
    for m in steps:
        # one on-policy step: ratio 1, so the token-mean policy loss -A is the mean of log pi_old - log pi_T
        assert m["pg_loss"] == pytest.approx(m["distill/reverse_kl"], abs=1e-5)
        assert m["distill/reverse_kl"] == pytest.approx(m["distill/student_logprob"] - m["distill/teacher_logprob"],
                                                        abs=1e-5)
        assert m["distill/teacher_logprob"] < 0 and "reward" in m
    assert "eval/accuracy" in read_metrics(run_dir)[-1]


def test_a_missing_teacher_path_is_exit_2_naming_the_key(tmp_path, capsys):
    assert main(["run", "distill", f"output_dir={tmp_path / 'run'}", *FEW]) == 2
    err = capsys.readouterr().err
    assert "'distill.teacher_path' is not set" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before the run folder is made
    assert main(["run", "distill", f"output_dir={tmp_path / 'run'}", f"distill.teacher_path={tmp_path / 'nope'}",
                 *FEW]) == 2
    assert "for 'distill.teacher_path': no such folder" in capsys.readouterr().err


@pytest.mark.parametrize("coef", ["-0.5", "abc", ".nan"])
def test_a_negative_task_coef_is_refused_by_validate_and_run(tmp_path, capsys, coef):
    # it once passed `rltk validate` and failed at the first step, after the teacher and student had loaded
    key = f"algorithm.advantage_fn_args.task_coef={coef}"
    assert main(["validate", "distill", key]) == 2
    err = capsys.readouterr().err
    # a negative number: the estimator's own rule; a word: the argument's type (float), checked first
    assert "'algorithm.advantage_fn_args.task_coef'" in err and "Traceback" not in err
    assert ("must be a number >= 0" if coef != "abc" else "bad value 'abc' for argument 'task_coef'") in err, err
    teacher = hf_teacher(tmp_path / "teacher")
    assert main(["run", "distill", f"output_dir={tmp_path / 'run'}", f"distill.teacher_path={teacher}", key,
                 *FEW]) == 2
    assert "'algorithm.advantage_fn_args.task_coef'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert main(["validate", "distill", "algorithm.advantage_fn_args.task_coef=0.5"]) == 0


def test_a_teacher_with_another_vocabulary_is_exit_2(tmp_path, capsys):
    # the tool-role tokenizer has one token more (<|tool|>): every id past it would mean something else
    teacher = hf_teacher(tmp_path / "teacher", tool_role=True)
    assert main(["run", "distill", f"output_dir={tmp_path / 'run'}", f"distill.teacher_path={teacher}", *FEW]) == 2
    err = capsys.readouterr().err
    assert "bad value" in err and "'distill.teacher_path'" in err and "not the student's" in err
    assert "only the teacher's: ['<|tool|>']" in err and "Traceback" not in err


def test_a_tokenizer_mapping_the_same_text_to_other_ids_is_refused(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from rltk.training.updates.distill import tokenizer_mismatch

    student = build_char_tokenizer()
    assert tokenizer_mismatch(student, build_char_tokenizer()) is None
    # the same tokens with the ids of '1' and '2' swapped: same vocabulary size, other ids for one text
    folder = hf_teacher(tmp_path / "teacher")
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    swapped = PreTrainedTokenizerFast.from_pretrained(str(folder))
    why = tokenizer_mismatch(student, swapped)
    assert why is not None and "other ids for ['1', '2']" in why
