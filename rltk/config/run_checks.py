"""Checks of what a run would refuse at its start: the seed's range, the local paths it reads, the
prompt template's fields."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rltk.config.errors import ConfigError
from rltk.data.templates import template_fields


#: The largest seed numpy and torch both accept.
SEED_MAX = 2**32 - 1


def check_seed(cfg: DictConfig) -> None:
    """The seed is one numpy's global seed takes: 0 .. 2**32 - 1 (it refuses anything else at the start of a run)."""
    if isinstance(cfg.seed, bool) or not 0 <= cfg.seed <= SEED_MAX:
        raise ConfigError(f"bad value {cfg.seed!r} for 'seed': must be an integer in [0, 2**32 - 1 = {SEED_MAX}]")


def check_paths(cfg: DictConfig) -> None:
    """Local paths the run reads exist, and model folders are folders with a config.json."""
    path = cfg.model.path
    if path:
        folder = Path(path).expanduser()
        if not folder.exists():
            raise ConfigError(
                f"bad value '{path}' for 'model.path': the folder does not exist. rltk loads models from local "
                f"folders only; download one first (e.g. `huggingface-cli download <repo> --local-dir <folder>`) "
                f"and set model.path=<folder>, or leave model.path null for the embedded tiny model"
            )
        if not folder.is_dir():
            raise ConfigError(
                f"bad value '{path}' for 'model.path': it is a file, not a model folder (expected a Hugging Face "
                f"model folder with config.json, weights and tokenizer files)"
            )
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"bad value '{path}' for 'model.path': not a Hugging Face model folder (no config.json in it)"
            )
    start = OmegaConf.select(cfg, "checkpoint.start_from")
    if start and not (Path(start).expanduser() / "state.json").is_file():
        raise ConfigError(
            f"bad value '{start}' for 'checkpoint.start_from': not a complete rltk checkpoint (no state.json in it); "
            f"give the step_XXXXXX folder that ends a stage of another run (<output_dir>/checkpoints)"
        )
    for key in ("data.path", "data.eval_path", "buffer.expert.path"):
        value = OmegaConf.select(cfg, key)
        if value and not Path(value).expanduser().exists():
            raise ConfigError(
                f"bad value '{value}' for '{key}': no such file or folder. rltk reads local datasets only "
                f"(json, jsonl, parquet, csv, or a datasets folder)"
            )


def check_prompt_template(cfg: DictConfig) -> None:
    """``data.prompt_template`` names plain fields only (see :mod:`rltk.data.templates`)."""
    try:
        template_fields(cfg.data.prompt_template, "data.prompt_template")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
