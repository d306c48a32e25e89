import pytest

from rltk.config.loader import load_config
from rltk.errors import ConfigError
from tests.builtin_plugins import ensure_registered


@pytest.fixture(autouse=True, scope="module")
def builtins():
    ensure_registered("tools", "tool_parsers", "multi_turn")


def test_defaults_follow_the_spec():
    cfg = load_config([], ["rollout.max_new_tokens=12"])
    assert dict(cfg.env) == {"environment": None, "environment_args": {}, "tools": [], "tools_args": {},
                             "mcp_servers": {}, "tool_parser": "hermes", "tool_parser_args": {}, "max_turns": 4,
                             "max_new_tokens_per_turn": 12, "max_total_tokens": 256}


def test_a_multi_turn_config_validates():
    cfg = load_config([], ["rollout.workflow=multi_turn", "env.tools=[calculator]", "model.tiny.tool_role=true",
                           "env.tools_args.calculator.max_length=50", "env.max_turns=3"])
    assert cfg.env.tools_args.calculator.max_length == 50


@pytest.mark.parametrize("overrides, message", [
    (["env.tools=[calculater]"], "unknown tool 'calculater' at 'env.tools'. Did you mean: 'calculator'?"),
    (["env.tool_parser=herms"], "unknown tool_parser 'herms' at 'env.tool_parser'. Did you mean: 'hermes'?"),
    (["env.environment=no_such_env"], "unknown environment 'no_such_env' at 'env.environment'"),
    (["env.environment_args.x=1"], "'env.environment_args' is set .* but 'env.environment' is null"),
    (["env.tools=[calculator,calculator]"], "'env.tools' names a tool twice"),
    (["env.tools=[calculator]", "env.tools_args.calculator.expression=1"],
     "'env.tools_args.calculator.expression': tool 'calculator': 'expression' is an argument the model passes"),
    (["env.tools=[calculator]", "env.tools_args.calculator.max_lenght=1"],
     "'env.tools_args.calculator.max_lenght': .*Did you mean: 'max_length'"),
    (["env.tools=[calculator]"], r"'env.tools' selects \['calculator'\] for the tiny model, whose tokenizer has no "
                                 r"tool role: set model.tiny.tool_role=true"),
    (["env.tools_args.calculator.digits=1"], "'env.tools_args.calculator': 'calculator' is not selected in 'env.tools'"),
    (["env.tool_parser_args.foo=1"], "'env.tool_parser_args.foo': tool_parser 'hermes' has no argument 'foo'"),
    (["env.max_turns=0"], "bad value 0 for 'env.max_turns': must be an integer >= 1"),
    (["env.max_total_tokens=0"], "bad value 0 for 'env.max_total_tokens'"),
    (["env.max_new_tokens_per_turn=-2"], "bad value -2 for 'env.max_new_tokens_per_turn'"),
    (["rollout.workflow_args.env={}"], "'rollout.workflow_args.env': 'env' is filled in"),
])
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], ["rollout.workflow=multi_turn", *overrides])


def test_a_workflow_that_ignores_the_section_does_not_check_it():
    cfg = load_config([], ["env.tool_parser=not_installed", "env.tools=[nope]"])
    assert cfg.rollout.workflow == "single_turn"


# ------------------------------------------------------- the warm-up's demonstrations against the rollout (issue 29)

AGENTIC_TOOLS = ["rollout.workflow=agentic", "rollout.workflow_args.agent=arithmetic_tools",
                 "data.task=calculator_arithmetic", "data.use_chat_template=true", "model.tiny.tool_role=true",
                 "data.train_size=40", "data.eval_size=4", "rollout.max_new_tokens=90", "data.max_prompt_tokens=64"]


def validate(capsys, *overrides):
    from rltk.commands.cli import main

    ensure_registered("agentic", "agents")
    code = main(["validate", "grpo", *overrides])
    return code, capsys.readouterr()


def test_demonstrations_that_call_tools_need_the_tools_rendered(capsys):
    # the first failed run: tools belonged to the agent, so the warm-up rendered its tool-calling
    # demonstrations without the tools block every RL request carried
    code, out = validate(capsys, *AGENTIC_TOOLS[:1], "rollout.workflow_args.agent=arithmetic_chat",
                         *AGENTIC_TOOLS[2:])
    assert code == 2
    assert "demonstrations call tools (row 'calculator_arithmetic/" in out.err and "calls 'calculator')" in out.err
    assert "'env.tools' is empty" in out.err
    code, out = validate(capsys, *AGENTIC_TOOLS, "env.tools=[calculator]")
    assert code == 0 and "the first 40 warm-up examples fit the rollout" in out.out


def test_an_agent_that_offers_the_given_tools_needs_env_tools(capsys):
    code, out = validate(capsys, *AGENTIC_TOOLS)
    assert code == 2 and "'env.tools' is empty, but agent 'arithmetic_tools' offers the tools rltk gives it" in out.err


def test_a_per_turn_cap_shorter_than_the_demonstrations_names_the_key_and_the_length(capsys):
    # the second failed run: a tool call of ~85 tokens under a cap of 60: every episode was cut
    code, out = validate(capsys, *AGENTIC_TOOLS, "env.tools=[calculator]", "env.max_new_tokens_per_turn=60")
    assert code == 2
    assert "40 of 40 warm-up demonstrations have an assistant turn of" in out.err
    needed = int(out.err.split("Raise env.max_new_tokens_per_turn to at least ")[1].split()[0])
    assert needed > 60
    code, out = validate(capsys, *AGENTIC_TOOLS, "env.tools=[calculator]", f"env.max_new_tokens_per_turn={needed}")
    assert code == 0
    code, out = validate(capsys, *AGENTIC_TOOLS, "env.tools=[calculator]", f"env.max_new_tokens_per_turn={needed}",
                         "env.max_turns=1")  # a call, its result, the answer: two requests
    assert code == 2 and "have 2 assistant turns" in out.err and "Raise env.max_turns to at least 2" in out.err
