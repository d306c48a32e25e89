"""Rewards that check an answer by rule: no model, no sandbox, bounded work (they run in the trainer's process).

* :mod:`rltk.rewards.verifiable.math`: ``exact_match`` and ``math_answer``, the final answer against the ground truth.
* :mod:`rltk.rewards.verifiable.countdown`: ``countdown``, the response's equation uses the numbers and hits the target.
* :mod:`rltk.rewards.verifiable.format`: ``format_tags``, the response follows a tag layout.
"""
