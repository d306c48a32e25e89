"""The errors every layer may raise, at the bottom of the package so any module can import them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem; the message names the key path, the value and what is valid."""
