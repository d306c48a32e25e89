"""The one error every config problem raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem; the message names the key path, the value and what is valid."""
