"""The config builder's form, generated: every schema key and every registered component, described as JSON.

Nothing here is written per field. The sections and keys come from the
dataclasses of :mod:`rltk.config.schema` (type, default, and the comment beside
or above the field as its doc); the component keys (:data:`COMPONENT_KEYS`)
get the names registered for their kind, plugins included, each with the
arguments of its own signature (minus those rltk fills in); the algorithm
presets list what each one sets. A plugin installed with pip therefore shows
up in the form with no UI code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import math
import re
import tokenize
import typing
from functools import lru_cache
from typing import Any

from rltk.config import schema as schema_module
from rltk.config.components import signature_params
from rltk.config.schema import CHOICES, COMPONENT_KEYS, RunConfig
from rltk.parsing import parse_python
from rltk.registry import KINDS, get_registry

#: What a new user sets (the beginner view): model, data, algorithm preset, steps, engine.
BEGINNER_KEYS = ("name", "model.path", "data.task", "data.path", "algorithm.name", "trainer.total_steps",
                 "rollout.engine", "rollout.n", "output_dir")


@lru_cache(maxsize=1)
def _field_comments() -> dict[tuple[str, str], str]:
    """``{(class name, field name): comment}`` from schema.py's source: the comment on a field's line, after the
    comment lines right above it."""
    source = inspect.getsource(schema_module)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in ast.walk(parse_python(source, schema_module.__file__)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                above, line = [], item.lineno - 1
                while line >= 1 and lines[line - 1].strip().startswith("#"):
                    above.insert(0, comments.get(line, ""))
                    line -= 1
                text = " ".join([*above, comments.get(item.lineno, "")]).strip()
                if text:
                    out[(node.name, item.target.id)] = text
    return out


def plain_text(doc: str) -> str:
    """A docstring as a reader sees it: RST markup dropped (````hf```` -> hf, ``:func:`x``` -> x)."""
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
    return re.sub(r"``([^`]+)``|`([^`]+)`", lambda m: m.group(1) or m.group(2), doc)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`*])")


def summary_of(doc: str) -> str:
    """A docstring's first paragraph as one line of plain text, and only its first sentence when the paragraph
    runs on (never cut in the middle of a sentence)."""
    paragraph = " ".join(plain_text(doc or "").strip().split("\n\n")[0].split())
    first = _SENTENCE_END.split(paragraph, maxsplit=1)[0]
    return paragraph if len(paragraph) <= 160 else first


def jsonable(value: Any) -> Any:
    """A default or argument value as JSON (non-finite floats and objects as text)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return repr(value)


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        made = field.default_factory()  # type: ignore[misc]
        return None if dataclasses.is_dataclass(made) else made  # a list of dataclasses (stages) stays
    return None


def _kind_of_type(annotation: str) -> str:
    """The widget a type asks for: bool, int, float, str, or yaml (lists, mappings, anything else)."""
    bare = annotation.replace("Optional[", "").rstrip("]").replace(" | None", "").strip()
    return {"bool": "bool", "int": "int", "float": "float", "str": "str"}.get(bare, "yaml")


def _section_doc(cls: type, parent: type | None, name: str) -> str:
    """What a section is for: its class's own docstring (first paragraph), else the comment beside the field
    that holds it in the parent class; never the signature dataclasses write into a class without a docstring."""
    doc = cls.__doc__ or ""
    if doc.startswith(cls.__name__ + "("):  # the repr dataclasses put there
        doc = ""
    if not doc and parent is not None:
        doc = _field_comments().get((parent.__name__, name), "")
    return " ".join(plain_text(inspect.cleandoc(doc)).split("\n\n")[0].split())


def _section(cls: type, prefix: str, parent: type | None = None) -> dict:
    hints = typing.get_type_hints(cls, vars(schema_module))
    comments = _field_comments()
    fields, subsections = [], []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            subsections.append(_section(hint, key + ".", cls))
            continue
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        entry = {"key": key, "type": annotation, "widget": _kind_of_type(annotation),
                 "nullable": "Optional" in annotation or "None" in annotation,
                 "default": jsonable(_default(f)), "doc": comments.get((cls.__name__, f.name), "")}
        if key in CHOICES:
            entry["choices"] = list(CHOICES[key])
        if key == "data.task":  # a registered task's name (plugins' too), or null with data.path
            entry["choices"] = sorted(get_registry().entries["task"])
        if key in COMPONENT_KEYS:
            kind, is_list = COMPONENT_KEYS[key]
            entry.update(component=kind, multiple=is_list, widget="component")
        fields.append(entry)
    name = prefix.rstrip(".").rsplit(".", 1)[-1]
    doc = "Top-level keys of a run." if cls is RunConfig else _section_doc(cls, parent, name)
    return {"key": prefix.rstrip("."), "title": prefix.rstrip(".") or "run", "doc": doc,
            "fields": fields, "sections": subsections}


def component_description(kind: str, entry) -> dict:
    """A registered component as the form shows it: plugin, summary, and its configurable arguments."""
    params, takes_kwargs = signature_params(entry.described)
    provided = KINDS[kind].provided
    args = []
    for name, p in params.items():
        if name in provided:
            continue
        annotation = "" if p.annotation is inspect.Parameter.empty else (
            p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", str(p.annotation)))
        required = p.default is inspect.Parameter.empty
        args.append({"name": name, "type": annotation, "widget": _kind_of_type(annotation) if annotation else "yaml",
                     "required": required, "default": None if required else jsonable(p.default)})
    doc = inspect.getdoc(entry.described) if not isinstance(entry.described, dict) else entry.described.get("description", "")
    return {"name": entry.name, "plugin": entry.plugin, "summary": summary_of(doc or ""),
            "doc": plain_text(doc or ""),
            "args": args, "takes_any": takes_kwargs}


def form_description() -> dict:
    """Everything the config builder draws: sections, components by kind, presets, beginner keys."""
    registry = get_registry()
    components = {}
    for kind in sorted({k for k, _ in COMPONENT_KEYS.values()}):
        if kind == "algorithm":
            continue
        components[kind] = [component_description(kind, e) for e in registry.entries[kind].values()]
    presets = {}
    for name, entry in registry.entries["algorithm"].items():
        sets = {f"algorithm.{k}": jsonable(v) for k, v in dict(entry.obj).items() if k != "description"}
        presets[name] = {"description": plain_text(dict(entry.obj).get("description", "")), "plugin": entry.plugin, "sets": sets}
    tasks = sorted(registry.entries["task"])
    return {"schema": _section(RunConfig, ""), "components": components, "presets": presets,
            "kinds": {k: KINDS[k].description for k in KINDS}, "tasks": tasks, "beginner": list(BEGINNER_KEYS)}
