"""OmegaConf configs: the schema, loading and merging, validation.

One concern a module: ``schema`` (types and defaults), ``loader`` (files,
overrides and presets merged into a run config), ``merge`` (merging onto the
schema with errors that name the key; stage overrides), ``resolvers``
(``${add:...}`` and friends), ``validation`` (the checks run on a merged
config, one section's checks after another), ``components`` (component names
and arguments), ``env_checks`` and ``lora_checks`` (the two sections whose
checks build components or a model), ``recipe_capabilities`` (what a recipe
serves), ``kl_warnings`` and ``preset_warnings`` (settings without effect) and
``errors`` (:class:`ConfigError`, defined in :mod:`rltk.errors`).
"""

from rltk.config.components import check_component_args
from rltk.config.errors import ConfigError
from rltk.config.loader import load_config, load_yaml, parse_overrides
from rltk.config.merge import apply_overrides
from rltk.config.recipe_capabilities import RecipeSpec
from rltk.config.schema import COMPONENT_KEYS, RunConfig
from rltk.config.validation import check_critic_config, validate_config

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
