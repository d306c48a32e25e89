"""The errors every layer may raise, at the bottom of the package so any module can import them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem; the message names the key path, the value and what is valid."""


class ProcessWaitError(RuntimeError):
    """A wait on another process (a rollout producer, the experience queue) ended without what it waited for;
    the message names the process or file, what was waited for, and where its log is."""
