import pytest

from tests.builtin_plugins import ensure_registered


@pytest.fixture(autouse=True, scope="session")
def builtins():
    ensure_registered("tools", "tool_parsers", "multi_turn")
