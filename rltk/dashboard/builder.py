"""The config builder's server side: overrides on a recipe's config -> YAML, command line, validation.

The page keeps a list of ``key=value`` overrides, exactly what one would type
after ``rltk run RECIPE``. From them this module writes the YAML (the
recipe's own config file with the overrides merged in) and checks it with
:func:`rltk.recipe_tools.validation.validate`, the code behind ``rltk validate``, on that YAML as
``rltk run RECIPE --config FILE`` would read it. The YAML is what is saved, so
what was validated is what runs.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rltk.errors import ConfigError
from rltk.recipe_tools.validation import UsageError, default_config_for, resolve_recipe, shipped_recipes, validate
from rltk.config.loader import load_config, load_yaml, parse_overrides
from rltk.registry import RegistryError

# A quoted key path in an error message: 'trainer.lr', 'algorithm.advantage_fn_args.eps', 'seed'.
_QUOTED = re.compile(r"'([A-Za-z_][\w\-]*(?:\.[\w\-]+)*)'")
SAVE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+\.ya?ml$")


def error_key(message: str, known: set[str]) -> str | None:
    """The config key an error message is about: the first quoted key path in it that is a known key, or the
    longest known key it starts with (``'algorithm.advantage_fn_args.foo'`` -> ``algorithm.advantage_fn_args``)."""
    for token in _QUOTED.findall(message):
        parts = token.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in known:
                return candidate
    return None


def leaf_values(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of every leaf of a config (lists kept whole, empty mappings as ``{}``)."""
    out: dict[str, Any] = {}
    if isinstance(node, dict):
        if not node and prefix:
            out[prefix] = {}
        for key, value in node.items():
            out.update(leaf_values(value, f"{prefix}.{key}" if prefix else str(key)))
    else:
        out[prefix] = node
    return out


def recipe_base(recipe: str) -> tuple[Path, Path | None]:
    """The recipe script and its own config file (None when it has none)."""
    script = resolve_recipe(recipe)
    return script, default_config_for(script)


def config_yaml(recipe: str, overrides: list[str]) -> str:
    """The recipe's config file with ``overrides`` merged in, as YAML for ``rltk run RECIPE --config FILE``."""
    _, default = recipe_base(recipe)
    base = load_yaml(default) if default is not None else OmegaConf.create({})
    merged = OmegaConf.merge(base, parse_overrides(overrides)) if overrides else base
    head = (f"# Built with `rltk dashboard` from the {recipe} recipe's config"
            + (f" and: {' '.join(overrides)}" if overrides else "") + "\n"
            + f"# Run it with: rltk run {recipe} --config <this file>\n")
    return head + OmegaConf.to_yaml(merged)


def command_line(recipe: str, overrides: list[str]) -> str:
    """The equivalent ``rltk run`` command (the recipe's own config plus the overrides)."""
    return " ".join(["rltk", "run", shlex.quote(recipe), *(shlex.quote(o) for o in overrides)])


def build(recipe: str, overrides: list[str], known_keys: set[str]) -> dict:
    """Validate ``overrides`` on ``recipe``'s config as ``rltk validate`` does; return what the page shows.

    ``{"ok", "message", "error": {"key", "message"} | None, "warnings", "values", "yaml", "command"}``:
    ``values`` are the config's leaves after the overrides (what each field shows), whether it validated or not.
    """
    result: dict[str, Any] = {"ok": False, "message": "", "error": None, "warnings": [], "values": {}, "yaml": "",
                              "command": command_line(recipe, overrides)}
    if recipe not in shipped_recipes():  # a shipped name only: the page never reads a path it was sent
        result["error"] = {"key": None, "message": f"recipe {recipe!r}: the dashboard builds configs for the shipped "
                                                   f"recipes ({', '.join(shipped_recipes())})"}
        return result
    try:
        result["yaml"] = config_yaml(recipe, overrides)
    except (ConfigError, RegistryError, UsageError) as exc:
        result["error"] = {"key": error_key(str(exc), known_keys), "message": str(exc)}
        return result
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(result["yaml"])
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                cfg, message = validate(recipe, [path], [])
            result.update(ok=True, message=message.replace(str(path), "<this file>"))
        except (ConfigError, RegistryError, UsageError) as exc:
            text = str(exc).replace(str(path), "<this file>")
            result["error"] = {"key": error_key(text, known_keys), "message": text}
            cfg = None
        result["warnings"] = [line.removeprefix("rltk: warning: ") for line in stderr.getvalue().splitlines()
                              if line.strip()]
        if cfg is None:  # the values as merged, unvalidated, so the form still shows what was typed
            with contextlib.suppress(Exception), contextlib.redirect_stderr(io.StringIO()):
                cfg = load_config([path], [], validate=False, warn=False)
    if isinstance(cfg, (DictConfig, ListConfig)):
        result["values"] = leaf_values(OmegaConf.to_container(cfg, resolve=False))
    return result


def save(recipe: str, overrides: list[str], name: str, folder: Path, known_keys: set[str]) -> dict:
    """Validate, then write the YAML as ``folder/name`` (a plain file name ending .yaml; never overwrites a
    file the builder did not write). Returns :func:`build`'s result with ``path`` and ``run_command``."""
    if not SAVE_NAME.match(name or ""):
        raise ValueError(f"file name {name!r}: use letters, digits, '.', '_' or '-' only, ending in .yaml")
    result = build(recipe, overrides, known_keys)
    if not result["ok"]:
        return result
    path = Path(folder) / name
    if path.exists() and not path.read_text().startswith("# Built with `rltk dashboard`"):
        result.update(ok=False, error={"key": None, "message": f"{path} exists and was not written by the dashboard;"
                                                                " choose another file name"})
        return result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result["yaml"])
    result["path"] = str(path)
    result["run_command"] = f"rltk run {shlex.quote(recipe)} --config {shlex.quote(str(path))}"
    return result


def recipes() -> list[str]:
    return list(shipped_recipes())
