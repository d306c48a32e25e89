"""W&B: offline works without network or account; no credentials online is a clear error, never a hang."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("wandb")

from rltk.loggers.wandb_logger import RUN_ID_FILE, WandbLogger  # noqa: E402

from tests.waits import scaled


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """Keep W&B's settings, cache and credentials lookups inside the test folder."""
    home = tmp_path / "home"
    home.mkdir()
    for var, sub in (("HOME", ""), ("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"),
                     ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("NETRC", str(home / "no-netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    return home


def test_offline_run_lives_in_run_dir_and_resume_keeps_the_run_id(tmp_path, wandb_home, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    logger = WandbLogger(run_dir=run_dir, config={"algorithm": {"name": "grpo"}}, total_steps=3)
    logger.log({"reward": 0.5, "kl": 0.01}, 1)
    logger.log({"reward": 0.75}, 2)
    # W&B commits a step when the next one starts: the summary holds step 1 now
    assert logger.run.summary["reward"] == 0.5 and logger.run.summary["_step"] == 1
    assert dict(logger.run.config) == {"algorithm": {"name": "grpo"}, "total_steps": 3}
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    assert logger.run.id == run_id
    logger.close()
    logger.close()
    assert list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))

    resumed = WandbLogger(run_dir=run_dir, config={}, total_steps=3, resume_step=2)
    assert resumed.run.id == run_id
    resumed.close()


def test_no_api_key_online_fails_at_once_with_what_to_do(tmp_path, wandb_home, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        WandbLogger(run_dir=tmp_path / "run", config={}, total_steps=1)
    assert time.monotonic() - started < scaled(10)
    message = str(info.value)
    assert "no W&B API key" in message
    assert "WANDB_MODE=offline" in message and "`wandb login`" in message and "remove 'wandb'" in message
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_unknown_mode_is_named(tmp_path, wandb_home):
    with pytest.raises(ValueError, match="mode='ofline'.*'online', 'offline' or 'disabled'"):
        WandbLogger(run_dir=tmp_path, config={}, total_steps=1, mode="ofline")
