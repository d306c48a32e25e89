"""OmegaConf configs: the schema, loading and merging, validation."""

from rltk.config.loader import (
    ConfigError,
    apply_overrides,
    check_component_args,
    load_config,
    load_yaml,
    parse_overrides,
    validate_config,
)
from rltk.config.schema import COMPONENT_KEYS, RunConfig

__all__ = [
    "COMPONENT_KEYS",
    "ConfigError",
    "RunConfig",
    "apply_overrides",
    "check_component_args",
    "load_config",
    "load_yaml",
    "parse_overrides",
    "validate_config",
]
