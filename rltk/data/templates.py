"""Prompt templates: ``str.format`` syntax restricted to plain field names.

``"Question: {prompt}\\nAnswer:"`` is filled with a row's prompt and extras.
Full ``str.format`` would also evaluate ``{prompt.__class__.__mro__}`` or
``{extras[0]}``: attribute and index lookups on objects, which can read
whatever those objects reach (a template shared in a config file is code
otherwise). So a template may hold only ``{name}`` fields, where ``name`` is
an identifier; no attribute access, indexing, positional ``{}``, conversion
(``!r``) or format spec (``:>10``). Literal braces are written ``{{`` and ``}}``.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

_FORMATTER = string.Formatter()


def template_fields(template: str, key: str) -> list[str]:
    """The field names of ``template``, in order; ``ValueError`` naming ``key`` if it is not allowed.

    Args:
        template: the template text.
        key: where the template came from (``data.prompt_template``), for the message.

    >>> template_fields("Q: {prompt} ({topic})", "data.prompt_template")
    ['prompt', 'topic']
    """
    if not isinstance(template, str):
        raise ValueError(f"{key} must be a string, got {type(template).__name__}: {template!r}")
    try:
        parts = list(_FORMATTER.parse(template))
    except ValueError as exc:
        raise ValueError(
            f"{key}={template!r} is not a valid template ({exc}); write literal braces as {{{{ and }}}}"
        ) from None
    names = []
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        field = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if not name.isidentifier():
            if "." in name or "[" in name:
                why = "attribute access and indexing are not allowed"
            elif name == "" or name.isdigit():
                why = "positional fields are not allowed"
            else:
                why = f"{name!r} is not a field name (letters, digits and '_', not starting with a digit)"
            raise ValueError(
                f"{key}={template!r} has the field {field}: {why}; a template may only name fields, as "
                f"{{prompt}} or {{<extras column>}} (write literal braces as {{{{ and }}}})"
            )
        if conversion or spec:
            raise ValueError(
                f"{key}={template!r} has the field {field}: conversions and format specs are not allowed; "
                f"write it as {{{name}}} (literal braces as {{{{ and }}}})"
            )
        names.append(name)
    return names


def fill_template(template: str, fields: Mapping[str, Any], key: str, where: str = "") -> str:
    """``template`` with each ``{name}`` replaced by ``str(fields[name])``.

    The template is checked by :func:`template_fields` (plain names only); a
    name ``fields`` lacks is a ``KeyError`` naming ``key``, ``where`` (e.g.
    ``row 'gsm-12'``) and the available names, as a ``ValueError`` like every
    other template problem. Nothing but ``str()`` is ever
    applied to a field's value.
    """
    template_fields(template, key)
    out = []
    for literal, name, _, _ in _FORMATTER.parse(template):
        out.append(literal)
        if name is None:
            continue
        if name not in fields:
            at = f" that {where} does not have" if where else " that is not available"
            raise ValueError(f"{key}={template!r} uses field '{name}'{at}. Available: {', '.join(sorted(fields))}")
        out.append(str(fields[name]))
    return "".join(out)
