"""OmegaConf configs: the schema, loading and merging, validation.

One concern a module: ``schema`` (types and defaults), ``loader`` (files,
overrides and presets merged into a run config), ``merge`` (merging onto the
schema with errors that name the key; stage overrides), ``resolvers``
(``${add:...}`` and friends), ``validation`` (the checks run on a merged
config), ``components`` (component names and arguments), ``run_checks`` (seed
and local paths), ``recipe_capabilities`` (what a recipe serves),
``critic_checks`` (the critic section), ``rollout_correction_checks`` (the
rollout/trainer mismatch correction), ``kl_warnings`` (KL settings without
effect) and ``errors`` (:class:`ConfigError`).
"""

from rltk.config.components import check_component_args
from rltk.config.critic_checks import check_critic_config
from rltk.config.errors import ConfigError
from rltk.config.loader import load_config, load_yaml, parse_overrides
from rltk.config.merge import apply_overrides
from rltk.config.recipe_capabilities import RecipeSpec
from rltk.config.schema import COMPONENT_KEYS, RunConfig
from rltk.config.validation import validate_config

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
