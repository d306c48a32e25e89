"""The keyword a transformers model takes its KV cache under, on both sides of a rename.

transformers 5.24 renamed the ``past_key_values`` argument of every decoder's ``forward`` (and of
``create_causal_mask``) to ``cache``, mapping the old name onto the new one with a FutureWarning
until 5.40, when the old name goes. rltk passes the name the installed release declares, read from
the signature (the deprecation wrapper keeps the wrapped function's signature), so the code is
right on either side and never leans on the mapping. A forward that declares neither name takes
no cache: callers that need one say so (:func:`rltk.notices.notice_once`) and take the full path.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

#: Newest first: the name a release declares is the one to pass.
CACHE_KEYWORDS = ("cache", "past_key_values")


def cache_keyword(fn: Callable) -> str | None:
    """``"cache"`` or ``"past_key_values"``: the KV-cache parameter ``fn`` declares; None if neither."""
    return _declared_cache_keyword(getattr(fn, "__func__", fn))


@functools.lru_cache(maxsize=None)
def _declared_cache_keyword(fn: Callable) -> str | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no Python signature to read
        return None
    return next((name for name in CACHE_KEYWORDS if name in params), None)
