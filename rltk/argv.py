"""The arguments a launcher adds to a process's command line, taken off before rltk parses its own.

Nothing here imports torch: the ``rltk`` command calls it before it knows which subcommand runs, and a
command that needs no torch (``rltk dashboard`` answering its page, ``rltk --help``) must not wait for it.
Also importable as ``rltk.distributed.strip_local_rank_argument``, where launcher users look for it.
"""

from __future__ import annotations

import os


def strip_local_rank_argument(argv: list[str]) -> list[str]:
    """``argv`` without the ``--local_rank=N`` / ``--local_rank N`` the ``deepspeed`` launcher appends.

    The launcher also exports ``LOCAL_RANK``; the value is copied there when
    the variable is missing, so nothing is lost. Call it before parsing a
    recipe's arguments: ``args = parse(strip_local_rank_argument(sys.argv[1:]))``.
    """
    kept: list[str] = []
    skip_next = False
    for i, arg in enumerate(argv):
        if skip_next:
            skip_next = False
            continue
        if arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            skip_next = True
        else:
            kept.append(arg)
    return kept
