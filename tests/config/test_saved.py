"""A run records its config resolved, except values read from the environment (secrets)."""

from __future__ import annotations

import types

import pytest
from omegaconf import OmegaConf

import rltk
from rltk.config import load_config
from rltk.config.saved import config_to_record, config_yaml_to_record
from rltk.training.scaffold.resume import check_compatible
from rltk.training.scaffold.run_outputs import build_loggers, prepare_run_dir

SECRET = "sk-do-not-write-me-0123456789"

CONFIG = """
name: secret-test
trainer:
  total_steps: ${add:2,3}
logging:
  logger: [capture]
  logger_args:
    capture:
      api_key: ${oc.env:RLTK_TEST_SECRET}
      same_key: ${.api_key}
      project: ${oc.env:RLTK_TEST_UNSET_PROJECT,rltk-tests}
      tags: ["${name}", "${logging.logger_args.capture.api_key}"]
      header: "Bearer ${logging.logger_args.capture.api_key}"
      plain: 7
"""


class CaptureLogger:
    seen: list = []

    def __init__(self, *, run_dir, config, total_steps, resume_step=None, **args):
        CaptureLogger.seen.append((config, args))

    def log(self, metrics, step):
        pass

    def close(self):
        pass


@pytest.fixture(autouse=True)
def capture_logger():
    """A logger taking any arguments, registered so the config may name it and give it arguments."""
    plugin = types.ModuleType("capture_logger_plugin")
    plugin.rltk_loggers = rltk.hookimpl(lambda: {"capture": CaptureLogger})
    rltk.register_plugin(plugin, name="capture_logger_plugin")
    CaptureLogger.seen.clear()
    yield
    rltk.unregister_plugin("capture_logger_plugin")


def _cfg(tmp_path, monkeypatch, secret=SECRET):
    monkeypatch.setenv("RLTK_TEST_SECRET", secret)
    monkeypatch.delenv("RLTK_TEST_UNSET_PROJECT", raising=False)
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return load_config([path], [f"output_dir={tmp_path / 'run'}"], warn=False)


def test_environment_reads_keep_their_interpolation_everything_else_is_resolved(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, monkeypatch)
    assert cfg.logging.logger_args.capture.api_key == SECRET  # the run itself sees the value
    record = config_to_record(cfg)
    args = record["logging"]["logger_args"]["capture"]
    assert args == {
        "api_key": "${oc.env:RLTK_TEST_SECRET}",
        "same_key": "${.api_key}",  # reaches the environment through another key
        "project": "${oc.env:RLTK_TEST_UNSET_PROJECT,rltk-tests}",  # a default does not make it safe to resolve
        "tags": ["secret-test", "${logging.logger_args.capture.api_key}"],
        "header": "Bearer ${logging.logger_args.capture.api_key}",
        "plain": 7,
    }
    assert record["trainer"]["total_steps"] == 5 and record["name"] == "secret-test"
    assert SECRET not in config_yaml_to_record(cfg)


def test_run_folder_config_has_no_secret_and_resolves_back(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, monkeypatch)
    run_dir = prepare_run_dir(cfg)
    text = (run_dir / "config.yaml").read_text()
    assert SECRET not in text and "${oc.env:RLTK_TEST_SECRET}" in text
    reread = OmegaConf.load(run_dir / "config.yaml")
    assert reread.logging.logger_args.capture.same_key == SECRET  # resolves from the environment again
    assert reread.trainer.total_steps == 5
    # The same config resumes its folder, also after the secret changed, and so does a folder written
    # by an rltk that saved the value itself.
    check_compatible(cfg, run_dir / "config.yaml", "the run folder")
    check_compatible(_cfg(tmp_path, monkeypatch, secret="rotated"), run_dir / "config.yaml", "the run folder")
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    check_compatible(cfg, run_dir / "config.yaml", "the run folder")


def test_loggers_get_the_recorded_config_but_their_own_arguments_resolved(tmp_path, monkeypatch):
    build_loggers(_cfg(tmp_path, monkeypatch), tmp_path, 5)
    [(config, args)] = CaptureLogger.seen
    assert SECRET not in repr(config)  # what W&B would upload as the run config
    assert args["api_key"] == SECRET and args["same_key"] == SECRET  # what the logger needs to log in
