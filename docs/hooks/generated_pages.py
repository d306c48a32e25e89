"""MkDocs hook: pages generated from the code at build time, never written by hand.

* ``reference/components.md``: every component of every kind in the registry (``rltk.list_components``):
  builtins and whatever plugins are installed (the example plugins in the test environment), each with
  its plugin, summary, first docstring paragraph (the formula, for algorithm components), whole
  docstring, and arguments with their defaults read from the signature. Register a component and it
  appears here with no edit to the docs.
* ``reference/batch-fields.md``: every field of a training batch with its shape, dtype and who fills it
  (``rltk.batch_types.TrainingBatch``).

Listed under ``hooks:`` in ``mkdocs.yml``; ``tests/test_docs.py`` builds the site and compares the
catalogue with the registry.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from mkdocs.structure.files import File

CATALOGUE = "reference/components.md"
BATCH_FIELDS = "reference/batch-fields.md"


def on_files(files, config):
    files.append(File.generated(config, CATALOGUE, content=catalogue_markdown()))
    files.append(File.generated(config, BATCH_FIELDS, content=batch_fields_markdown()))
    return files


# ---------------------------------------------------------------------------------------------- helpers


def _escape(text: str) -> str:
    """Plain text safe inside a Markdown paragraph or table cell (no links, emphasis or HTML)."""
    text = re.sub(r"([\\`*_\[\]<>|#])", r"\\\1", text)
    return text.replace("\n", " ")


def _prose(text: str) -> str:
    """A docstring line as Markdown: its ``literal`` spans as code, everything else escaped."""
    parts = re.split(r"``(.+?)``", text)
    return "".join(_code(part) if i % 2 else _escape(part) for i, part in enumerate(parts))


def _code(text: str) -> str:
    """Inline code that may itself hold backticks or pipes (table cells)."""
    text = text.replace("\n", " ")  # a pipe inside a code span is not a cell border
    ticks = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _fence(text: str) -> str:
    return "```text\n" + text.rstrip() + "\n```"


def _anchor(kind: str, name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{kind}-{name}".lower()).strip("-")


def _where(obj: Any) -> str:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else type(obj).__name__


def _annotation(param: inspect.Parameter) -> str:
    if param.annotation is inspect.Parameter.empty:
        return ""
    ann = param.annotation
    return ann if isinstance(ann, str) else inspect.formatannotation(ann)


def _arguments(obj: Any, provided: frozenset[str]) -> list[str]:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return ["Signature not readable (a builtin or C callable)."]
    rows = []
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            name = f"*{param.name}"
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            name = f"**{param.name}"
        else:
            name = param.name
        if param.name in provided:
            default, role = "", "filled in by rltk"
        elif param.default is inspect.Parameter.empty and param.kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            default, role = "", "required"
        elif param.default is inspect.Parameter.empty:
            default, role = "", "extra arguments"
        else:
            default, role = _code(repr(param.default)), "config"
        ann = _annotation(param)
        rows.append(f"| {_code(name)} | {default} | {_code(ann) if ann else ''} | {role} |")
    if not rows:
        return ["No arguments."]
    return ["| argument | default | annotation | set by |", "|---|---|---|---|", *rows]


def _split_docstring(doc: str) -> tuple[str, int, str]:
    """(what to show open, paragraphs shown, the rest): the first paragraph after the summary line and the
    next one, plus the block a paragraph ending in ':' or '::' introduces (where a formula usually sits)."""
    paragraphs = re.split(r"\n\s*\n", doc)
    first = paragraphs[0].split("\n", 1)
    head = [first[1]] if len(first) > 1 and first[1].strip() else []
    shown = 1
    while shown < len(paragraphs) and (shown < 2 or head and head[-1].rstrip().endswith(":")):
        head.append(paragraphs[shown])
        shown += 1
    return "\n\n".join(head), shown, "\n\n".join(paragraphs[shown:])


def _preset(obj: dict) -> list[str]:
    rows = [f"| {_code(key)} | {_code(repr(value))} |" for key, value in obj.items() if key != "description"]
    return ["| key | value |", "|---|---|", *rows] if rows else ["Sets nothing."]


# ---------------------------------------------------------------------------------------------- pages


def catalogue_markdown() -> str:
    from rltk.config.schema import COMPONENT_KEYS
    from rltk.registry import KINDS, get_registry, list_components
    from rltk.registration.stage_spec import StageSpec

    registry = get_registry()
    keys_of: dict[str, list[str]] = {}
    for key, (kind, many) in COMPONENT_KEYS.items():
        keys_of.setdefault(kind, []).append(f"{key}=[...]" if many else key)

    entries = list_components()
    out = [
        "# Component catalogue",
        "",
        "Generated when the site is built, from the registry of the environment that built it "
        "(`rltk.list_components()`): rltk's builtins and every installed plugin "
        "(here the example plugins, `plugins/rltk-plugin-example` and `plugins/rltk-plugin-wordle`). "
        "`rltk list KIND` prints the same names with their first docstring line; "
        "[The registry and hook points](../concepts/registry.md) says how a component gets here. "
        "Arguments marked *filled in by rltk* come from the batch or the run and may not be set in a config; "
        "the others are set as `<key>_args.<argument>` beside the key that names the component "
        "(`algorithm.policy_loss_args.clip_eps_high=0.28`).",
        "",
        f"{len(entries)} components of {len(KINDS)} kinds from "
        f"{len({e.plugin for e in entries})} plugins.",
        "",
        "| kind | what | chosen by | hook | names |",
        "|---|---|---|---|---|",
    ]
    for kind in KINDS.values():
        names = sorted(registry.entries[kind.name])
        chosen = ", ".join(_code(k) for k in keys_of.get(kind.name, [])) or "workflow or recipe code"
        links = ", ".join(f"[{_code(n)}](#{_anchor(kind.name, n)})" for n in names) or "none registered"
        out.append(f"| [{_code(kind.name)}](#kind-{kind.name}) | {_escape(kind.description)} | {chosen} "
                   f"| {_code(kind.hook)} | {links} |")
    for kind in KINDS.values():
        out += ["", f"## `{kind.name}`: {_escape(kind.description)} {{#kind-{kind.name}}}", ""]
        chosen = ", ".join(_code(k) for k in keys_of.get(kind.name, []))
        out.append(f"Registered through the hook `{kind.hook}`" + (f"; chosen by {chosen}." if chosen else "."))
        if kind.provided:
            out.append(f"rltk fills in: {', '.join(_code(p) for p in sorted(kind.provided))}.")
        for entry in list_components(kind.name):
            out += ["", f"### `{entry.name}` {{#{_anchor(kind.name, entry.name)}}}", ""]
            obj = entry.obj
            facts = [f"plugin {_code(entry.plugin)}"]
            if not isinstance(obj, dict):
                facts.append(_code(_where(obj)))
            if entry.overrides:
                facts.append(f"overrides {_code(entry.overrides)}")
            out.append(" · ".join(facts))
            out.append("")
            if isinstance(obj, dict):
                out.append(_prose(str(obj.get("description", ""))) or "No description.")
                out += ["", *_preset(obj)]
                continue
            if isinstance(obj, StageSpec):  # a training loop: what it provides, its loop named, not imported
                out.append(_prose(obj.description) or "No description.")
                loop = obj.loop if isinstance(obj.loop, str) else _where(obj.loop)
                facts = {"loop": loop, **obj.provides, "rl": obj.rl, "chainable": obj.chainable}
                out += ["", "| key | value |", "|---|---|",
                        *(f"| {_code(k)} | {_code(repr(v))} |" for k, v in facts.items())]
                continue
            doc = inspect.getdoc(obj) or ""
            if not doc:
                out.append("No docstring.")
            else:
                out.append(f"**{_prose(entry.summary)}**")
                lead, shown, rest = _split_docstring(doc)
                if lead:
                    out += ["", _fence(lead)]
                if rest:
                    body = "\n".join("    " + line if line else "" for line in _fence(rest).splitlines())
                    out += ["", '??? note "The rest of the docstring"', "", body]
            out += ["", *_arguments(obj, kind.provided)]
    return "\n".join(out) + "\n"


def batch_fields_markdown() -> str:
    from typing import get_type_hints

    from rltk import batch_types

    hints = get_type_hints(batch_types.TrainingBatch, include_extras=True)
    doc = inspect.getdoc(batch_types)
    out = [
        "# Batch fields",
        "",
        "Generated from `rltk.batch_types.TrainingBatch` when the site is built: every field a training "
        "batch may hold. `B` is the number of responses, `P` the prompt width (left-padded), `T` the "
        "response width (right-padded), `K` the number of reward functions. An advantage estimator or a "
        "policy loss names the fields it reads as keyword arguments (see the "
        "[component catalogue](components.md)).",
        "",
        "| field | shape | dtype | filled by |",
        "|---|---|---|---|",
    ]
    for name, hint in hints.items():
        shape, dtype, who = hint.__metadata__[:3]
        out.append(f"| {_code(name)} | {_code(shape)} | {_code(dtype)} | {_escape(who)} |")
    out += ["", "## The module's own account", "", _fence(doc or "")]
    return "\n".join(out) + "\n"
