"""Issue 12, items 1 and 5: checkpoints never run code on load, damaged ones are skipped, extras are pruned.

The checkpoint here is the one the default strategy (accelerate) writes for a
tiny Qwen2; DeepSpeed's layout is covered by tests/strategies/test_deepspeed_checkpoint_safety.py.
"""

from __future__ import annotations

import json
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.checkpoint import CheckpointManager
from rltk.config import load_config
from rltk.errors import ConfigError
from rltk.serialization import CheckpointFileError, DamagedCheckpointError, UnsafeCheckpointError
from rltk.training.scaffold.export import export_checkpoint
from rltk.training.scaffold.resume import load_weights, resume_or_start_over, save_weights_atomically
from rltk.training.scaffold.run_outputs import prepare_run_dir
from tests.test_checkpoint import new_strategy, train_step
from tests.test_serialization import Payload, plant

REPO = Path(__file__).resolve().parents[1]
GRPO_YAML = REPO / "recipes" / "configs" / "grpo.yaml"

#: Every file of an accelerate checkpoint; test_the_planted_files_are_every_file_of_the_checkpoint keeps it complete.
ACCELERATE_FILES = ["manifest.json", "model/config.json", "model/generation_config.json", "model/model.safetensors",
                    "optimizer.pt", "rng/rank_00000.pt", "scheduler.pt", "state.json", "strategy.json"]


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """Checkpoints of steps 1 and 2 of a tiny model trained with AdamW (``root/step_00000{1,2}``)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("template") / "checkpoints"
        torch.manual_seed(0)
        strategy = new_strategy(seed=0)
        manager = CheckpointManager(root, keep_last=None)
        for step in (1, 2):
            train_step(strategy)
            manager.save(step, strategy, {"step": step})
        return root
    finally:
        torch.set_num_threads(previous)


def copy_of(template: Path, folder: Path, steps=(1, 2)) -> Path:
    root = folder / "checkpoints"
    root.mkdir(parents=True)
    for step in steps:
        shutil.copytree(template / f"step_{step:06d}", root / f"step_{step:06d}")
    return root


def files_of(checkpoint: Path) -> list[str]:
    return sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# --------------------------------------------------------------------------
# Item 1: a planted pickle never runs
# --------------------------------------------------------------------------


def test_the_planted_files_are_every_file_of_the_checkpoint(template):
    assert files_of(template / "step_000002") == ACCELERATE_FILES


def test_a_fresh_checkpoint_is_intact(template):
    manager = CheckpointManager(template)
    assert manager.verify(template / "step_000002") == []
    assert manager.latest_intact() == template / "step_000002"


@pytest.mark.parametrize("relative", ACCELERATE_FILES)
def test_a_payload_planted_in_any_file_is_refused_naming_the_file_and_never_runs(template, tmp_path, relative):
    root = copy_of(template, tmp_path, steps=(2,))
    checkpoint = root / "step_000002"
    marker = tmp_path / "MARKER"
    plant(checkpoint / relative, marker)
    is_pickle_file = relative.endswith(".pt")

    # Loading it into a strategy (what a resumed stage does) ...
    with pytest.raises(UnsafeCheckpointError if is_pickle_file else DamagedCheckpointError) as caught:
        CheckpointManager(root).load(checkpoint, new_strategy(seed=1))
    assert str(checkpoint / relative) in str(caught.value) or relative in str(caught.value)
    # ... and choosing it as the resume point (what `rltk run` with checkpoint.resume=auto does first).
    with pytest.raises(CheckpointFileError) as caught:
        CheckpointManager(root).latest_intact()
    assert relative in str(caught.value)
    if is_pickle_file:
        assert isinstance(caught.value, UnsafeCheckpointError) and "could run arbitrary code" in str(caught.value)
    else:  # a pickle where JSON or safetensors belongs is no payload anyone reads: the file is damaged
        assert "every checkpoint under" in str(caught.value)
    assert not marker.exists()
    assert checkpoint.is_dir()  # refused, not moved aside: there is nothing intact to fall back to


@pytest.mark.parametrize("protocol", [2, 5])
def test_a_bare_pickle_payload_is_refused_too(template, tmp_path, protocol):
    """Not torch's zip format: protocol 2 is refused by torch's unpickler at the global, protocol 5 at its
    first frame, where rltk reads the opcodes (without running them) to name what it asks for."""
    root = copy_of(template, tmp_path, steps=(2,))
    marker = tmp_path / "MARKER"
    (root / "step_000002" / "optimizer.pt").write_bytes(pickle.dumps({"state": Payload(marker)}, protocol=protocol))
    with pytest.raises(UnsafeCheckpointError, match=r"optimizer.pt': it (asks the unpickler for|is a pickle that "
                                                    r"asks for) posix.system"):
        CheckpointManager(root).latest_intact()
    assert not marker.exists()


def test_a_payload_is_refused_even_when_an_older_checkpoint_is_intact(template, tmp_path):
    """Tampering is not damage: the run stops instead of quietly resuming an older step."""
    root = copy_of(template, tmp_path)
    marker = tmp_path / "MARKER"
    plant(root / "step_000002" / "scheduler.pt", marker)
    with pytest.raises(UnsafeCheckpointError, match=r"step_000002/scheduler.pt"):
        CheckpointManager(root).latest_intact()
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002"]
    assert not marker.exists()


def test_a_payload_in_a_file_the_save_did_not_write_is_refused(template, tmp_path):
    """A planted extra file (say a DeepSpeed universal checkpoint beside the shards) is checked as well."""
    root = copy_of(template, tmp_path, steps=(2,))
    marker = tmp_path / "MARKER"
    (root / "step_000002" / "deepspeed_universal").mkdir()
    plant(root / "step_000002" / "deepspeed_universal" / "optimizer_state.pt", marker)
    with pytest.raises(UnsafeCheckpointError, match="deepspeed_universal/optimizer_state.pt"):
        CheckpointManager(root).verify(root / "step_000002")
    assert not marker.exists()


def test_export_refuses_a_planted_or_damaged_checkpoint(template, tmp_path):
    root = copy_of(template, tmp_path, steps=(1, 2))
    marker = tmp_path / "MARKER"
    plant(root / "step_000002" / "optimizer.pt", marker)
    with pytest.raises(UnsafeCheckpointError, match="optimizer.pt"):
        export_checkpoint(root / "step_000002", tmp_path / "out")
    truncate(root / "step_000001" / "model" / "model.safetensors")
    with pytest.raises(DamagedCheckpointError, match=r"step_000001' is damaged: model/model.safetensors"):
        export_checkpoint(root / "step_000001", tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------
# Item 5: damaged checkpoints
# --------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_cutting_any_file_of_a_checkpoint_anywhere_is_found_and_named(template, data):
    relative = data.draw(st.sampled_from(ACCELERATE_FILES))
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = Path(folder) / "step_000002"
        shutil.copytree(template / "step_000002", checkpoint)
        whole = (checkpoint / relative).read_bytes()
        cut = data.draw(st.integers(0, len(whole) - 1))
        (checkpoint / relative).write_bytes(whole[:cut])
        damage = CheckpointManager(folder).verify(checkpoint)
        assert checkpoint / relative in [d.path for d in damage]


@pytest.mark.parametrize("relative", [f for f in ACCELERATE_FILES if f.endswith(".json")])
def test_cutting_only_the_last_byte_of_a_json_file_is_found(template, tmp_path, relative):
    """A JSON text cut after its last brace could still parse; the manifest's sizes (or, for the manifest
    itself, ending on its closing brace) make the cut visible anyway."""
    root = copy_of(template, tmp_path, steps=(2,))
    path = root / "step_000002" / relative
    path.write_bytes(path.read_bytes()[:-1])
    assert path in [d.path for d in CheckpointManager(root).verify(root / "step_000002")]


@pytest.mark.parametrize("relative", ["model/model.safetensors", "state.json", "optimizer.pt", "rng/rank_00000.pt",
                                      "strategy.json"])
def test_auto_resume_falls_back_to_the_newest_intact_checkpoint_naming_the_damage(template, tmp_path, relative):
    root = copy_of(template, tmp_path)
    truncate(root / "step_000002" / relative)
    manager = CheckpointManager(root, keep_last=2)
    with pytest.warns(UserWarning) as warned:
        chosen = manager.latest_intact()
    assert chosen == root / "step_000001"
    message = str(warned[0].message)
    assert f"'{root / 'step_000002'}' is damaged: {relative} (" in message
    assert f"Resuming from the newest intact checkpoint, '{root / 'step_000001'}'" in message
    # Moved aside, so it neither counts towards keep_last nor is resumed again.
    assert sorted(p.name for p in root.iterdir()) == ["damaged-step_000002", "step_000001"]
    assert f"moved to '{root / 'damaged-step_000002'}'" in message
    assert CheckpointManager(root).load(chosen, new_strategy(seed=1)) == {"step": 1}


def test_other_processes_fall_back_without_moving_anything(template, tmp_path, recwarn):
    root = copy_of(template, tmp_path)
    truncate(root / "step_000002" / "model" / "model.safetensors")
    assert CheckpointManager(root).latest_intact(main_process=False) == root / "step_000001"
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002"]
    assert not [w for w in recwarn if "damaged" in str(w.message)]


def test_a_missing_file_or_one_of_another_size_is_damage(template, tmp_path):
    root = copy_of(template, tmp_path, steps=(2,))
    checkpoint = root / "step_000002"
    (checkpoint / "scheduler.pt").unlink()
    # Same kind, still parses, other size: a file from another checkpoint copied over this one.
    torch.save({"other": torch.zeros(100)}, checkpoint / "optimizer.pt")
    damage = CheckpointManager(root).verify(checkpoint)
    assert {d.path.name: d.reason for d in damage} == {
        "optimizer.pt": f"it is {(checkpoint / 'optimizer.pt').stat().st_size} bytes but was saved with "
                        f"{json.loads((checkpoint / 'manifest.json').read_text())['files']['optimizer.pt']} "
                        "(truncated or replaced)",
        "scheduler.pt": "the file is missing; the checkpoint was saved with it",
    }


def test_every_checkpoint_damaged_is_an_error_listing_each_and_nothing_is_moved(template, tmp_path):
    root = copy_of(template, tmp_path)
    truncate(root / "step_000002" / "model" / "model.safetensors")
    (root / "step_000001" / "state.json").write_text('{"step": 1, "sta')
    with pytest.raises(DamagedCheckpointError) as caught:
        CheckpointManager(root).latest_intact()
    message = str(caught.value)
    assert message.startswith(f"every checkpoint under '{root}' is damaged, so there is nothing to resume: "
                              "step_000002: model/model.safetensors (it is not a complete safetensors file")
    assert "step_000001: state.json (it is not valid JSON" in message and "checkpoint.resume=never" in message
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002"]


def test_a_checkpoint_without_a_manifest_is_checked_by_its_files(template, tmp_path):
    """Checkpoints saved before the manifest existed are still told intact or damaged."""
    root = copy_of(template, tmp_path, steps=(2,))
    checkpoint = root / "step_000002"
    (checkpoint / "manifest.json").unlink()
    assert CheckpointManager(root).verify(checkpoint) == []
    truncate(checkpoint / "optimizer.pt")
    assert [d.path for d in CheckpointManager(root).verify(checkpoint)] == [checkpoint / "optimizer.pt"]


def test_new_checkpoints_after_a_fallback_are_kept(template, tmp_path):
    """keep_last=1: had the damaged step 2 stayed a step_ folder, saving step 2 again would be the only
    thing keeping it, and every save before would have pruned the fresh checkpoint instead."""
    root = copy_of(template, tmp_path)
    truncate(root / "step_000002" / "model" / "model.safetensors")
    manager = CheckpointManager(root, keep_last=1)
    with pytest.warns(UserWarning, match="is damaged"):
        assert manager.latest_intact() == root / "step_000001"
    manager.save(2, None, {"step": 2})
    assert sorted(p.name for p in root.iterdir()) == ["damaged-step_000002", "step_000002"]
    assert manager.latest_intact() == root / "step_000002"


def test_a_damaged_frozen_reference_file_is_named(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = tmp_path / "stage_weights" / "stage_1_reference.safetensors"
    save_weights_atomically(model.state_dict(), path)
    truncate(path)
    with pytest.raises(DamagedCheckpointError, match=r"stage_1_reference.safetensors: it is not a complete safet"):
        load_weights(path, model)


# --------------------------------------------------------------------------
# Through the run's resume decision (rltk.training.scaffold.resume)
# --------------------------------------------------------------------------


def run_folder(tmp_path: Path, steps: list[int], *overrides: str):
    """A run folder whose checkpoints hold only state and RNG (no strategy), as resume_or_start_over sees it."""
    run_dir = tmp_path / "run"
    cfg = load_config([GRPO_YAML], [f"output_dir={run_dir}", *overrides], warn=False)
    prepare_run_dir(cfg)
    manager = CheckpointManager(run_dir / "checkpoints", keep_last=None)
    for step in steps:
        manager.save(step, None, {"stage": 1, "stage_step": step, "stage_done": False})
    return cfg, CheckpointManager(run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last)


def test_a_run_killed_between_save_and_prune_is_pruned_when_it_resumes(tmp_path, capsys):
    cfg, manager = run_folder(tmp_path, [2, 4, 6, 8], "checkpoint.keep_last=2")
    (manager.root / ".tmp-step_000010").mkdir()  # and a save killed before its rename
    resume = resume_or_start_over(cfg, manager)
    assert resume["path"] == manager.root / "step_000008" and resume["global_step"] == 8
    assert sorted(p.name for p in manager.root.iterdir()) == ["step_000006", "step_000008"]
    assert "rltk: removed step_000002, step_000004 from" in capsys.readouterr().out


def test_only_the_main_process_prunes(tmp_path):
    cfg, manager = run_folder(tmp_path, [2, 4, 6], "checkpoint.keep_last=1")
    resume_or_start_over(cfg, manager, main_process=False)
    assert len(list(manager.root.iterdir())) == 3


def test_an_explicit_older_checkpoint_is_never_pruned_at_start(tmp_path):
    cfg, manager = run_folder(tmp_path, [2, 4, 6], "checkpoint.keep_last=1")
    cfg.checkpoint.resume = str(manager.root / "step_000002")
    assert resume_or_start_over(cfg, manager)["global_step"] == 2
    assert sorted(p.name for p in manager.root.iterdir()) == ["step_000002", "step_000006"]


def test_auto_resume_of_a_run_folder_falls_back_and_an_explicit_damaged_checkpoint_is_a_config_error(tmp_path):
    cfg, manager = run_folder(tmp_path, [2, 4])
    truncate(manager.root / "step_000004" / "state.json")
    with pytest.warns(UserWarning, match=r"step_000004' is damaged: state.json \(it is not valid JSON"):
        assert resume_or_start_over(cfg, manager)["global_step"] == 2
    truncate(manager.root / "step_000002" / "rng" / "rank_00000.pt")
    cfg.checkpoint.resume = str(manager.root / "step_000002")
    with pytest.raises(ConfigError, match=r"checkpoint.resume='.*step_000002' is a damaged checkpoint: "
                                          r"rng/rank_00000.pt \(.*Choose another step_XXXXXX folder"):
        resume_or_start_over(cfg, manager)


@settings(max_examples=60, deadline=None)
@given(steps=st.sets(st.integers(0, 40), min_size=0, max_size=8), keep_last=st.integers(1, 5),
       keep_index=st.one_of(st.none(), st.integers(0, 7)))
def test_prune_keeps_the_newest_keep_last_and_the_resume_point_and_touches_nothing_else(steps, keep_last, keep_index):
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for step in steps:
            (root / f"step_{step:06d}").mkdir()
            (root / f"step_{step:06d}" / "state.json").write_text(json.dumps({"step": step, "state": {}}))
        for other in ("damaged-step_000003", "step_000099", "notes"):  # not rltk's checkpoints: left alone
            (root / other).mkdir()
        (root / ".tmp-step_000050").mkdir()
        (root / ".old-step_000001").mkdir()
        ordered = sorted(steps)
        chosen = keep_index is not None and keep_index < len(ordered)
        keep = root / f"step_{ordered[keep_index]:06d}" if chosen else None
        CheckpointManager(root, keep_last=keep_last).prune(keep=keep)
        expected = {f"step_{s:06d}" for s in ordered[-keep_last:]} | ({keep.name} if keep else set())
        remaining = {p.name for p in root.iterdir()}
        assert remaining == expected | {"damaged-step_000003", "step_000099", "notes"}


def test_a_manifest_pointing_outside_the_checkpoint_is_damage(template, tmp_path):
    root = copy_of(template, tmp_path, steps=(2,))
    manifest = root / "step_000002" / "manifest.json"
    payload = json.loads(manifest.read_text())
    payload["files"]["../../secret.pt"] = 10
    manifest.write_text(json.dumps(payload))
    damage = CheckpointManager(root).verify(root / "step_000002")
    assert [(d.path.name, d.reason) for d in damage] == [
        ("manifest.json", "it lists '../../secret.pt', a path outside the checkpoint")]


def test_files_behind_a_symlinked_folder_are_checked_through_the_manifest(template, tmp_path):
    """os.walk does not enter a symlinked folder; the manifest still names what a strategy would read there."""
    root = copy_of(template, tmp_path, steps=(2,))
    checkpoint = root / "step_000002"
    elsewhere = tmp_path / "elsewhere"
    shutil.move(checkpoint / "rng", elsewhere)
    (checkpoint / "rng").symlink_to(elsewhere, target_is_directory=True)
    assert CheckpointManager(root).verify(checkpoint) == []
    marker = tmp_path / "MARKER"
    plant(elsewhere / "rank_00000.pt", marker)
    with pytest.raises(UnsafeCheckpointError, match=r"rng/rank_00000.pt"):
        CheckpointManager(root).verify(checkpoint)
    assert not marker.exists()
