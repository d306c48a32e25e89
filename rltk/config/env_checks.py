"""The ``env`` section: environment, tools and tool parser are registered, their arguments fit, limits are positive.

Checked when the chosen workflow reads the section (its class takes ``env``,
as ``multi_turn`` does), so a typo in a name fails at validation like any
other component name, before anything heavy starts. A run whose workflow
ignores the section (``single_turn``) does not depend on the components it
names being installed.
"""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf

from rltk.config.components import check_component_args, signature_params
from rltk.config.errors import ConfigError
from rltk.registry import Registry, did_you_mean, unknown_name_message


def workflow_reads_env(cfg: DictConfig, registry: Registry) -> bool:
    """Whether ``rollout.workflow`` (already checked to be registered) takes the ``env`` section."""
    entry = registry.entries["workflow"].get(cfg.rollout.workflow)
    return entry is not None and "env" in signature_params(entry.obj)[0]


def check_env(cfg: DictConfig, registry: Registry) -> None:
    """Raise :class:`ConfigError` naming the ``env.*`` key of the first problem."""
    env = cfg.get("env")
    if env is None or not workflow_reads_env(cfg, registry):
        return
    name = env.environment
    if name is not None:
        table = registry.entries["environment"]
        if not isinstance(name, str) or name not in table:
            raise ConfigError(unknown_name_message("environment", str(name), list(table), where="env.environment"))
        check_component_args("environment", name, table[name].obj, env.environment_args, "env.environment_args")
    elif env.environment_args:
        raise ConfigError(f"'env.environment_args' is set ({OmegaConf.to_container(env.environment_args)}) but "
                          f"'env.environment' is null; name an environment or remove its arguments")

    tools = env.tools
    if not isinstance(tools, (list, ListConfig)):
        raise ConfigError(f"'env.tools' must be a list of tool names, got {tools!r}")
    table = registry.entries["tool"]
    for tool_name in tools:
        if not isinstance(tool_name, str) or tool_name not in table:
            raise ConfigError(unknown_name_message("tool", str(tool_name), list(table), where="env.tools"))
    if len(set(tools)) != len(tools):
        raise ConfigError(f"'env.tools' names a tool twice: {list(tools)}")
    for tool_name, args in (env.tools_args or {}).items():
        if tool_name not in tools:
            raise ConfigError(f"'env.tools_args.{tool_name}': '{tool_name}' is not selected in 'env.tools' "
                              f"(selected: {', '.join(tools) or '(none)'})")
        if not isinstance(args, (dict, DictConfig)):
            raise ConfigError(f"'env.tools_args.{tool_name}' must be a mapping of argument names to values, "
                              f"got {args!r}")
        tool = table[tool_name].obj
        valid = tool.configurable() if hasattr(tool, "configurable") else []
        for arg in args:
            try:
                tool.bind(**{arg: args[arg]})
            except ValueError as exc:
                raise ConfigError(f"'env.tools_args.{tool_name}.{arg}': {exc}.{did_you_mean(arg, valid)}") from None
    if tools and cfg.model.path is None and not cfg.model.tiny.tool_role:
        # tool results are `tool` messages; without the token the template refuses them mid-rollout
        raise ConfigError(f"'env.tools' selects {list(tools)} for the tiny model, whose tokenizer has no tool "
                          f"role: set model.tiny.tool_role=true (adds the <|tool|> token)")

    table = registry.entries["tool_parser"]
    parser = env.tool_parser
    if not isinstance(parser, str) or parser not in table:
        raise ConfigError(unknown_name_message("tool_parser", str(parser), list(table), where="env.tool_parser"))
    check_component_args("tool_parser", parser, table[parser].obj, env.tool_parser_args, "env.tool_parser_args")

    for key in ("max_turns", "max_new_tokens_per_turn", "max_total_tokens"):
        value = OmegaConf.select(cfg, f"env.{key}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"bad value {value!r} for 'env.{key}': must be an integer >= 1")
