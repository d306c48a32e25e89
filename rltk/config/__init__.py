"""OmegaConf configs: the schema, loading and merging, validation.

One concern a module: ``schema`` (types and defaults), ``loader`` (files,
overrides and presets merged into a run config), ``merge`` (merging onto the
schema with errors that name the key; stage overrides), ``resolvers``
(``${add:...}`` and friends), ``validation`` (the checks run on a merged
config, one section's checks after another), ``components`` (component names
and arguments), ``env_checks`` and ``lora_checks`` (the two sections whose
checks build components or a model), ``recipe_capabilities`` (what a recipe
serves), ``kl_warnings`` and ``preset_warnings`` (settings without effect).

Every config problem raises :class:`rltk.errors.ConfigError`, imported from there (below every layer) and
nowhere else. Its two other names, ``rltk.config.ConfigError`` and ``rltk.config.errors.ConfigError``, keep
working for one release, with a ``DeprecationWarning``.
"""

import warnings

from rltk.config.components import check_component_args
from rltk.config.loader import load_config, load_yaml, parse_overrides
from rltk.config.merge import apply_overrides
from rltk.config.recipe_capabilities import RecipeSpec
from rltk.config.schema import COMPONENT_KEYS, RunConfig
from rltk.config.validation import check_critic_config, validate_config
from rltk.notices import alias_moved_modules

alias_moved_modules({f"{__name__}.errors": "rltk.errors"})

__all__ = [
    "COMPONENT_KEYS",
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


def __getattr__(name: str):
    if name == "ConfigError":
        warnings.warn("rltk.config.ConfigError moved to rltk.errors.ConfigError: import it from there (the old name "
                      "goes in the next release)", DeprecationWarning, stacklevel=2)
        from rltk.errors import ConfigError

        return ConfigError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
