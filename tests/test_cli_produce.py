"""`rltk produce RUN_DIR`: bad input exits 2 naming the flag or key, a run that never starts exits 3 naming
the file it waited for. (A producer feeding a real run: tests/recipes/test_async_recipe.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rltk.commands.cli import main
from rltk.commands.produce import _claim, find_stage

from tests.waits import scaled


def rendezvous(run_dir: Path, stage: int = 1, local: int = 0) -> Path:
    folder = run_dir / "async" / f"stage_{stage}"
    folder.mkdir(parents=True)
    (folder / "producer.json").write_text(json.dumps({
        "stage": stage, "config": str(folder / "producer_config.yaml"), "queue": str(folder / "q.sqlite"),
        "weights": str(folder / "policy.safetensors"), "timeout_s": 5.0, "local_producers": local}))
    return folder


def test_a_synchronous_run_is_refused_naming_its_mode(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("trainer:\n  mode: sync\n")
    assert main(["produce", str(tmp_path), "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert "trains with trainer.mode=sync" in err and "reads no experience queue" in err
    assert "Traceback" not in err


def test_a_finished_run_is_refused(tmp_path, capsys):
    (tmp_path / "summary.json").write_text("{}")
    assert main(["produce", str(tmp_path), "--timeout", "30"]) == 2
    assert "has finished (summary.json): no asynchronous stage is left" in capsys.readouterr().err


def test_a_file_where_the_run_folder_belongs_is_refused(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    assert main(["produce", str(path)]) == 2
    assert "is a file; pass the run's output_dir" in capsys.readouterr().err


@pytest.mark.parametrize("args, match", [
    (["--name", "a b"], "bad value 'a b' for --name: letters, digits"),
    (["--name", ".x"], "bad value '.x' for --name"),
    (["--index", "2", "--count", "2"], "bad value --index 2 --count 2"),
    (["--index", "0"], "--index and --count go together"),
    (["--timeout", "0"], "bad value 0.0 for --timeout"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, args, match):
    assert main(["produce", str(tmp_path), *args]) == 2
    assert match in capsys.readouterr().err


def test_a_run_that_never_starts_its_asynchronous_stage_ends_the_wait_naming_the_file(tmp_path, capsys):
    start = time.monotonic()
    assert main(["produce", str(tmp_path / "not_yet"), "--timeout", "1"]) == 3
    assert time.monotonic() - start < scaled(10)
    err = capsys.readouterr().err
    assert "waited 1 s (--timeout) for the trainer of" in err and "async/stage_<i>/producer.json" in err


def test_the_newest_stage_is_found_and_a_name_in_use_is_refused(tmp_path, capsys):
    rendezvous(tmp_path, stage=1)
    folder = rendezvous(tmp_path, stage=3, local=1)
    assert find_stage(tmp_path, None, 1.0)["stage"] == 3
    assert find_stage(tmp_path, 1, 1.0)["stage"] == 1
    # the trainer's own producers' names are taken
    assert main(["produce", str(tmp_path), "--name", "producer-0"]) == 2
    assert "the trainer runs its own producers producer-0..producer-0" in capsys.readouterr().err
    held = _claim(folder, "ext-a")  # a live producer named ext-a
    try:
        assert main(["produce", str(tmp_path), "--name", "ext-a"]) == 2
        err = capsys.readouterr().err
        assert "bad value 'ext-a' for --name: a producer with that name is running for this stage" in err
        assert "give each producer its own --name" in err
    finally:
        held.close()


def test_overrides_change_known_keys_and_a_components_arguments_and_refuse_typos():
    from omegaconf import OmegaConf

    from rltk.commands.produce import _apply_overrides

    cfg = OmegaConf.create({"rollout": {"engine": "hf", "engine_args": {}}, "seed": 1})
    got = _apply_overrides(cfg, ["rollout.engine=vllm_server", "rollout.engine_args.servers=[http://h:8000]"])
    assert got.rollout.engine == "vllm_server" and list(got.rollout.engine_args.servers) == ["http://h:8000"]
    from rltk.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown config key 'rollout.engin' in override 'rollout.engin=hf'"):
        _apply_overrides(cfg, ["rollout.engin=hf"])
