"""CONTRIBUTING.md's table of builtin algorithm components stays current with the registry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import rltk

KINDS = ["advantage_fn", "kl_penalty_fn", "loss_agg", "policy_loss", "preference_loss", "algorithm"]


def catalogue() -> str:
    text = (Path(__file__).resolve().parents[2] / "CONTRIBUTING.md").read_text()
    start = text.index("### The builtin algorithm components")
    return text[start : text.index("\n## ", start)]


@pytest.mark.parametrize("kind", KINDS)
def test_every_builtin_component_is_in_contributings_table(kind):
    rows = [line for line in catalogue().splitlines() if line.startswith("|")]
    # a kind's rows run from the row naming it to the next row that names another kind
    listed, current = set(), None
    for row in rows:
        first = row.split("|")[1].strip()
        if first:
            current = first.split()[0].strip("`")
        if current == kind:
            listed |= set(re.findall(r"`([^`\s]+)`", row.split("|")[2]))
    builtin = {e.name for e in rltk.list_components(kind) if e.plugin.startswith("rltk:")}
    assert builtin, kind
    missing = sorted(builtin - listed)
    assert not missing, f"CONTRIBUTING.md's component table lacks {kind} {missing}"
    assert not sorted(listed - builtin), f"CONTRIBUTING.md lists {kind} that are not registered"
