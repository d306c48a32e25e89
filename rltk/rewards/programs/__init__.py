"""The ``code_execution`` reward: the model's program run against tests in a sandbox.

* :mod:`rltk.rewards.programs.code_execution`: the reward function: the program from the response, the tests,
  the fraction passed.
* :mod:`rltk.rewards.programs.assert_tests`: an assert test split into probes run inside and a check judged outside.
* :mod:`rltk.rewards.programs.plain_data`: the tagged JSON values cross the sandbox's wall in.
* :mod:`rltk.rewards.programs.sandbox`: the parent half of the sandbox (Linux namespaces, rlimits, no network).
* :mod:`rltk.rewards.programs.sandbox_launcher`: its inside half, started as a file, never imported.
"""
