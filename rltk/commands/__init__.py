"""The commands: what ``rltk`` does when typed in a shell.

* :mod:`~rltk.commands.cli`: ``rltk run | validate | list | plugins | export | ...`` (``console_main``).
* :mod:`~rltk.commands.serve`: ``rltk serve``, a checkpoint behind the OpenAI-compatible endpoint.
* :mod:`~rltk.commands.new_plugin`: ``rltk new plugin NAME --kind KIND``, a plugin package to start from.
* :mod:`~rltk.commands.produce`: ``rltk produce RUN_DIR``, a rollout producer for a run on another machine.
"""
