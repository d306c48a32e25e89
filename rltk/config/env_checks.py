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
from rltk.errors import ConfigError
from rltk.registry import Registry, did_you_mean, unknown_name_message
from rltk.tools.mcp import check_server_config
from rltk.tools.resolve import is_mcp_name


def workflow_reads_env(cfg: DictConfig, registry: Registry) -> bool:
    """Whether ``rollout.workflow`` (already checked to be registered) takes the ``env`` section."""
    entry = registry.entries["workflow"].get(cfg.rollout.workflow)
    return entry is not None and "env" in signature_params(entry.described)[0]


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
        check_component_args("environment", name, table[name].described, env.environment_args, "env.environment_args")
    elif env.environment_args:
        raise ConfigError(f"'env.environment_args' is set ({OmegaConf.to_container(env.environment_args)}) but "
                          f"'env.environment' is null; name an environment or remove its arguments")

    tools = env.tools
    if not isinstance(tools, (list, ListConfig)):
        raise ConfigError(f"'env.tools' must be a list of tool names, got {tools!r}")
    table = registry.entries["tool"]
    servers = env.get("mcp_servers") or {}
    if not isinstance(servers, (dict, DictConfig)):
        raise ConfigError(f"'env.mcp_servers' must map server names to their settings, got {servers!r}")
    for server, spec in servers.items():
        check_server_config(server, OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig)
                            else spec)
    for tool_name in tools:
        if isinstance(tool_name, str) and is_mcp_name(tool_name):
            server = tool_name.partition(".")[0]
            if server not in servers:  # the server's own tool names are checked when it is first reached
                raise ConfigError(f"'env.tools' names '{tool_name}', a tool of MCP server '{server}', but "
                                  f"'env.mcp_servers' has no '{server}' (it has: {', '.join(servers) or '(none)'})")
            continue
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
        if is_mcp_name(tool_name):
            raise ConfigError(f"'env.tools_args.{tool_name}': a tool of an MCP server takes no configured "
                              f"arguments (the server owns its configuration)")
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
    check_component_args("tool_parser", parser, table[parser].described, env.tool_parser_args, "env.tool_parser_args")

    for key in ("max_turns", "max_new_tokens_per_turn", "max_total_tokens"):
        value = OmegaConf.select(cfg, f"env.{key}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"bad value {value!r} for 'env.{key}': must be an integer >= 1")


def check_agent_tools(cfg: DictConfig, registry: Registry) -> None:
    """An agent that offers the tools it is given (a ``tools`` parameter) needs them in ``env.tools``."""
    workflow = registry.entries["workflow"].get(cfg.rollout.workflow)
    if workflow is None or "agent" not in (getattr(workflow.described, "component_args", None) or {}):
        return
    name = OmegaConf.select(cfg, "rollout.workflow_args.agent")
    entry = registry.entries["agent"].get(name) if isinstance(name, str) else None
    if entry is not None and "tools" in signature_params(entry.described)[0] and not cfg.env.tools:
        raise ConfigError(f"'env.tools' is empty, but agent '{name}' offers the tools rltk gives it: list them in "
                          f"env.tools (e.g. env.tools=[calculator]); the warm-up renders the same list into its "
                          f"prompts and demonstrations")


def demonstration_turn_caps(cfg: DictConfig) -> dict[str, tuple[str, int]]:
    """What bounds a demonstrated episode when the policy plays it: ``{what: (config key, value)}``.

    ``turn`` (tokens of one assistant turn, its eos included), ``turns`` (assistant turns) and
    ``response`` (the whole response after the opening), by workflow: ``single_turn`` one turn of
    ``rollout.max_new_tokens``; ``multi_turn`` ``env.max_new_tokens_per_turn``, ``env.max_turns``
    and ``env.max_total_tokens``; ``agentic`` (requests to the endpoint) ``env.max_new_tokens_per_turn``
    and ``env.max_turns``.
    """
    per_turn = ("env.max_new_tokens_per_turn", cfg.env.max_new_tokens_per_turn)
    if cfg.rollout.workflow == "multi_turn":
        return {"turn": per_turn, "turns": ("env.max_turns", cfg.env.max_turns),
                "response": ("env.max_total_tokens", cfg.env.max_total_tokens)}
    if cfg.rollout.workflow == "agentic":
        return {"turn": per_turn, "turns": ("env.max_turns", cfg.env.max_turns)}
    return {"turn": ("rollout.max_new_tokens", cfg.rollout.max_new_tokens), "turns": ("(one turn)", 1)}


def check_demonstrations(cfg: DictConfig, rows: list[dict], pairs: list[tuple[list[int], ...]]) -> None:
    """The warm-up's demonstrations are episodes the rollout can play: the tools they call reach the chat
    template, and no demonstrated turn is longer than the cap the rollout puts on it.

    ``rows`` are the training rows and ``pairs`` their warm-up examples (``rltk.training.scaffold.rows.sft_pairs``:
    ``(prompt ids, response ids, loss mask)``, the mask 1 on each assistant turn and its eos). A
    demonstration that calls a tool while ``env.tools`` is empty was rendered without the tools block
    the rollout's prompts carry, so the warm-up teaches a prompt the policy is never served; a turn
    over its cap is cut in every episode that plays it (``truncated_fraction`` 1.0 and no reward).
    Both are :class:`ConfigError` naming the row and the key to change.
    """
    tools = set(cfg.env.tools or [])
    for row in rows if not cfg.sft.completion_key else []:  # a completion_key replaces the transcripts
        for message in row.get("sft_messages") or []:
            for call in message.get("tool_calls") or []:
                name = (call.get("function") or call).get("name")
                if not tools:
                    raise ConfigError(
                        f"the warm-up's demonstrations call tools (row '{row.get('id')}' calls '{name}'), but "
                        f"'env.tools' is empty, so the chat template renders them without the tools block that "
                        f"every rollout request with tools= carries: the warm-up would teach a prompt the policy "
                        f"is never served. List the tools in env.tools (the agentic workflow gives the same list "
                        f"to an agent that takes `tools`)")
                if name not in tools:
                    raise ConfigError(
                        f"row '{row.get('id')}': its demonstration calls '{name}', which is not in 'env.tools' "
                        f"({', '.join(sorted(tools))}); the warm-up renders only those tools")
    caps = demonstration_turn_caps(cfg)
    worst: dict[str, tuple[int, str]] = {}
    over: dict[str, int] = {}
    for row, (_, response_ids, *mask) in zip(rows, pairs):
        mask = list(mask[0]) if mask else [1] * len(response_ids)
        turns = _runs_of_ones(mask)
        measured = {"turn": max(turns, default=0), "turns": len(turns), "response": len(response_ids)}
        for what, (key, cap) in caps.items():
            if isinstance(cap, int) and measured[what] > cap:
                over[what] = over.get(what, 0) + 1
                if measured[what] > worst.get(what, (0, ""))[0]:
                    worst[what] = (measured[what], str(row.get("id")))
    for what, (key, cap) in caps.items():
        if what not in over:
            continue
        longest, row_id = worst[what]
        phrase = {"turn": f"an assistant turn of {longest} tokens (eos included)",
                  "turns": f"{longest} assistant turns", "response": f"a response of {longest} tokens"}[what]
        if key == "(one turn)":
            raise ConfigError(
                f"{over[what]} of the warm-up's demonstrations have several assistant turns (row '{row_id}': "
                f"{longest}), but rollout.workflow={cfg.rollout.workflow} plays one; use rollout.workflow=multi_turn "
                f"or agentic")
        raise ConfigError(
            f"{over[what]} of {len(pairs)} warm-up demonstrations have {phrase} (row '{row_id}'), "
            f"more than {key}={cap}: every episode that plays one is cut there (truncated, so no reward). Raise "
            f"{key} to at least {longest}")


def _runs_of_ones(mask: list[int]) -> list[int]:
    """Lengths of the runs of 1 in ``mask``: the demonstration's assistant turns, eos included."""
    runs, current = [], 0
    for value in mask:
        if value:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return runs
