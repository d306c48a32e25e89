"""OmegaConf configs: the schema, loading and merging, validation."""

from rltk.config.loader import (
    ConfigError,
    RecipeSpec,
    apply_overrides,
    check_component_args,
    check_critic_config,
    load_config,
    load_yaml,
    parse_overrides,
    validate_config,
)
from rltk.config.schema import COMPONENT_KEYS, RunConfig

__all__ = [
    "COMPONENT_KEYS",
    "ConfigError",
    "RecipeSpec",
    "RunConfig",
    "apply_overrides",
    "check_component_args",
    "check_critic_config",
    "load_config",
    "load_yaml",
    "parse_overrides",
    "validate_config",
]
