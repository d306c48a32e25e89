"""Every list of batch fields agrees with the one contract, rltk.batch_types.TrainingBatch.

The registry's fields derive from it; the stages' provides, what collate builds (names, ranks and
dtypes), the CONTRIBUTING table and the docstring tables of rltk.batch and rltk.algorithms.advantages
are checked against it here, so a field added in one place and not the others fails a test.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

import rltk.algorithms.advantages as advantages_module
import rltk.batch as batch_module
from rltk.batch import Experience, collate
from rltk.batch_types import BATCH_FIELDS, FIELD_DTYPES, FIELD_SHAPES, TrainingBatch
from rltk.recipe_tools.validation import shipped_recipe_spec, shipped_recipes
from rltk.registry import KINDS

ROOT = Path(__file__).resolve().parents[1]


def test_the_registry_takes_its_fields_from_the_contract():
    assert KINDS["advantage_fn"].provided == BATCH_FIELDS
    assert set(FIELD_SHAPES) == set(TrainingBatch.__annotations__)


def test_what_each_recipe_provides_is_a_field_of_the_contract():
    for name in shipped_recipes():
        spec = shipped_recipe_spec(name)
        if spec.batch_fields is not None:
            assert spec.batch_fields <= set(FIELD_SHAPES), (name, sorted(spec.batch_fields - set(FIELD_SHAPES)))


def test_collate_builds_contract_fields_with_their_shapes_and_dtypes():
    experiences = [
        Experience(prompt_ids=[1, 2], response_ids=[3, 4, 5], score=1.0, group_id=0, rollout_logprobs=[-1.0] * 3,
                   reward_details={"a": 1.0}, baseline_score=0.5),
        Experience(prompt_ids=[6], response_ids=[7], score=0.0, group_id=0, reward_details={"a": 0.0},
                   baseline_score=0.5),
    ]
    batch = collate(experiences, pad_token_id=0, reward_names=["a"])
    hints = TrainingBatch.__annotations__
    assert set(batch) <= set(hints), sorted(set(batch) - set(hints))
    sizes = {"B": 2, "P": 2, "T": 3, "P + T": 5, "K": 1}
    for name, tensor in batch.items():
        shape = FIELD_SHAPES[name].strip("[]").split(", ")
        assert list(tensor.shape) == [sizes[dim] for dim in shape], (name, tuple(tensor.shape), FIELD_SHAPES[name])
        assert tensor.dtype == getattr(torch, FIELD_DTYPES[name]), (name, tensor.dtype, FIELD_DTYPES[name])


def test_the_contributing_table_lists_contract_fields_only():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text[text.index("The batch fields"):]
    table = table[: table.index("\n\n", table.index("|"))]
    listed = {name for row in table.splitlines() if row.startswith("| `")
              for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert listed and listed <= BATCH_FIELDS, sorted(listed - BATCH_FIELDS)
    # the advantage_fn row names the fields an estimator may take
    row = next(line for line in text.splitlines() if line.startswith("| `advantage_fn`"))
    named = set(re.findall(r"`(\w+)`", row[: row.index("see the batch fields")]))
    assert named - {"advantage_fn", "algorithm", "rltk_advantage_fns"} <= BATCH_FIELDS


def test_the_docstring_tables_name_contract_fields():
    # rltk.batch: "name  [shape]" lines; rltk.algorithms.advantages: the ``name`` ``[shape]`` table
    collated = set(re.findall(r"^    (\w+)\s*\[", batch_module.__doc__, flags=re.M))
    assert collated and collated <= set(FIELD_SHAPES), sorted(collated - set(FIELD_SHAPES))
    for name in collated:
        line = re.search(rf"^    {name}\s*(\[[^\]]+\])", batch_module.__doc__, flags=re.M).group(1)
        assert line.replace(" ", "") == FIELD_SHAPES[name].replace(" ", ""), (name, line, FIELD_SHAPES[name])
    table = re.findall(r"^``(\w+)``\s+``(\[[^`]+\])``", advantages_module.__doc__, flags=re.M)
    assert table
    for name, shape in table:
        assert name in FIELD_SHAPES, name
        assert shape.replace(" ", "") == FIELD_SHAPES[name].replace(" ", ""), (name, shape, FIELD_SHAPES[name])
