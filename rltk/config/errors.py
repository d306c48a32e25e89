"""The one error every config problem raises (defined in :mod:`rltk.errors`, below every layer)."""

from rltk.errors import ConfigError

__all__ = ["ConfigError"]
