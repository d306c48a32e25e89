"""The parallel layout's coordinates, groups and refusals, checked against hand-written grids."""

import itertools

import pytest

from rltk.errors import ConfigError
from rltk.strategies.layout import ParallelLayout
from tests.waits import scaled


def test_eight_ranks_at_sp2_tp2_sit_where_the_grid_says():
    layout = ParallelLayout(world_size=8, sequence_parallel_size=2, tensor_parallel_size=2)
    assert layout.data_world_size == 2
    # tp innermost, then sp, then dp
    assert [tuple(layout.coordinates(r).values()) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [layout.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.group_ranks("tp", 5) == [4, 5]
    assert layout.group_ranks("sp", 5) == [5, 7]
    assert layout.group_ranks("dp", 5) == [1, 5]


@pytest.mark.parametrize("world,sp,tp", [(1, 1, 1), (4, 2, 1), (4, 1, 2), (8, 2, 2), (12, 3, 2), (6, 1, 3)])
def test_every_rank_is_in_exactly_one_group_per_axis_and_rank_at_inverts_coordinates(world, sp, tp):
    layout = ParallelLayout(world_size=world, sequence_parallel_size=sp, tensor_parallel_size=tp)
    for rank in range(world):
        assert layout.rank_at(**layout.coordinates(rank)) == rank
    for axis in ("dp", "sp", "tp"):
        groups = {tuple(layout.group_ranks(axis, r)) for r in range(world)}
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(world))


def test_experts_shard_over_consecutive_data_ranks_of_the_same_model_parallel_position():
    layout = ParallelLayout(world_size=8, tensor_parallel_size=2, expert_parallel_size=2)
    assert layout.data_world_size == 4
    assert layout.expert_group_ranks(0) == [0, 2] and layout.expert_group_ranks(3) == [1, 3]
    assert layout.expert_group_ranks(5) == [5, 7]
    assert ParallelLayout(world_size=4, expert_parallel_size=2).expert_group_ranks(3) == [2, 3]


@pytest.mark.parametrize("args,match", [
    ({"sequence_parallel_size": 3}, r"strategy_args\.sequence_parallel_size=3 x .* does not divide the 4 processes"),
    ({"tensor_parallel_size": 0}, r"strategy_args\.tensor_parallel_size: 0 is not a whole number"),
    ({"tensor_parallel_size": True}, r"strategy_args\.tensor_parallel_size: True"),
    ({"tensor_parallel_size": 2, "expert_parallel_size": 4}, r"strategy_args\.expert_parallel_size=4 does not divide the 2"),
])
def test_sizes_that_do_not_fit_the_world_name_the_key(args, match):
    with pytest.raises(ConfigError, match=match):
        ParallelLayout.from_strategy_args(args, world_size=4)


def test_no_arguments_is_data_parallel_only():
    layout = ParallelLayout.from_strategy_args({}, world_size=3)
    assert layout.is_data_parallel_only and layout.data_world_size == 3 and layout.data_rank(2) == 2


@pytest.mark.parametrize("name,match", [
    ("ulysses_sequence_parallel_size", r"verl's and Trinity-RFT's name; rltk's is strategy_args\.sequence_parallel_size"),
    ("tensor_model_parallel_size", r"Megatron's name; rltk's is strategy_args\.tensor_parallel_size"),
    ("expert_model_parallel_size", r"Megatron's name; rltk's is strategy_args\.expert_parallel_size"),
    ("pipeline_parallel_size", r"pipeline parallelism is not built in rltk .* strategy_args\.tensor_parallel_size"),
    ("context_parallel_size", r"ring attention\) is not built .* strategy_args\.sequence_parallel_size"),
])
def test_a_peers_name_for_a_size_is_refused_naming_rltks_key(name, match):
    from rltk.strategies.layout import check_peer_size_names

    with pytest.raises(ConfigError, match=match):
        check_peer_size_names({name: 2})
    check_peer_size_names({"sequence_parallel_size": 2, "fsdp": True})  # rltk's own names pass


def test_rltk_validate_refuses_a_peers_name_with_exit_2_and_one_line():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rltk.commands.cli", "validate", "grpo",
                          "strategy_args.tensor_model_parallel_size=2"], capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 2, out.stderr
    assert "rltk's is strategy_args.tensor_parallel_size" in out.stderr and "Traceback" not in out.stderr
