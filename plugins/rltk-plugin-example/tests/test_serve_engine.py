"""The example's server engine: registered through the entry point, with the capabilities the trainer reads
inherited from rltk's server pool. It runs against real endpoints in rltk's own tests
(tests/rollout/test_server_pool.py, tests/recipes/test_async_server_engine.py)."""

import inspect

import rltk
from rltk.rollout.server_pool import ServerPoolEngine
from rltk_plugin_example import serve_engine
from rltk_plugin_example.serve_engine import RltkServeEngine


def test_registered_through_entry_point_as_a_server_engine():
    assert rltk.get_component("rollout_engine", "rltk_serve") is RltkServeEngine
    plugins = {e.name: e.plugin for e in rltk.list_components("rollout_engine")}
    assert plugins["rltk_serve"] == "rltk-plugin-example:example"
    assert issubclass(RltkServeEngine, ServerPoolEngine)
    assert (RltkServeEngine.runs_in_producer, RltkServeEngine.loads_weight_files,
            RltkServeEngine.owns_servers, RltkServeEngine.samples_from_module) == (True, True, True, False)


def test_a_server_engine_is_one_short_file():
    # the pool, launch, timeouts, abort-and-continue, versions, weight files and close come from the base
    assert len(inspect.getsource(serve_engine).splitlines()) < 130
