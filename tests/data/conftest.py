import pytest

from tests.builtin_plugins import ensure_registered


@pytest.fixture(autouse=True)
def builtin_tasks():
    """The builtin tasks, also where the installed rltk metadata predates their entry point."""
    ensure_registered("tasks")
