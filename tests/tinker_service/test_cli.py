"""``rltk serve-tinker``'s refusals: exit code 2 and one line naming the flag, before any model loads."""

from __future__ import annotations

import pytest

from rltk.commands.cli import main

pytest.importorskip("tinker")


@pytest.mark.parametrize("argv, message", [
    (["--api-key", "sk-123"], "--api-key values must start with 'tml-'"),
    (["--session-timeout", "5"], "--session-timeout must be more than the SDK's heartbeat period of 10 s"),
    (["--max-datums", "0"], "--max-datums must be an integer >= 1, got 0"),
])
def test_bad_flags_exit_2_naming_the_flag(capsys, argv, message):
    assert main(["serve-tinker", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_listening_beyond_loopback_without_a_key_is_warned_about(capsys):
    # 203.0.113.1 (TEST-NET-3) is on no interface here: the warning comes first, then the bind fails in one line
    assert main(["serve-tinker", "--host", "203.0.113.1", "--port", "0", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "rltk serve-tinker: WARNING: listening on 203.0.113.1 without an API key" in err
    assert "cannot listen on 203.0.113.1:0 (--host/--port)" in err and "Traceback" not in err

