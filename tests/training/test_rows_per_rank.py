"""Each process takes its share of a step's rows: too few rows for the process count is a config error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rltk.errors import ConfigError
from rltk.training.stages.run import require_rows_per_rank


def test_fewer_rows_than_processes_names_the_key_and_the_least_valid_value():
    with pytest.raises(ConfigError, match=r"trainer.prompts_per_step=3 .* 4 data-parallel ranks .* at least 4"):
        require_rows_per_rank(SimpleNamespace(data_world_size=4), "trainer.prompts_per_step", 3)


def test_one_row_per_process_is_enough():
    require_rows_per_rank(SimpleNamespace(data_world_size=4), "sft.batch_size", 4)
