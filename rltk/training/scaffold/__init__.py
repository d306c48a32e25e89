"""What every run is built from and writes around its loop (the ground floor of ``rltk.training``).

* :mod:`~rltk.training.scaffold.setup`: the tokenizer, policy, strategy, workflow and reward from the config
  (``args_of`` reads a component's arguments beside its name).
* :mod:`~rltk.training.scaffold.rows`: the training and held-out rows, SFT pairs, tool schemas.
* :mod:`~rltk.training.scaffold.resume`: where a run resumes (or starts over), and loading weights and RNG.
* :mod:`~rltk.training.scaffold.run_outputs`: the run folder, the loggers, ``summary.json``.
* :mod:`~rltk.training.scaffold.guard`: the divergence guard that stops a run that stopped learning.
* :mod:`~rltk.training.scaffold.traces`: a bounded sample of each step's trajectories (``traces.jsonl``).
* :mod:`~rltk.training.scaffold.evaluation`: held-out evaluation of the current policy.
* :mod:`~rltk.training.scaffold.export`: a checkpoint as a plain Hugging Face model folder.
"""
