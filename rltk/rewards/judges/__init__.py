"""Rewards where a model judges the response.

* :mod:`rltk.rewards.judges.reward_model`: ``reward_model``, a sequence-classification model, local or behind a URL.
* :mod:`rltk.rewards.judges.reward_server`: that model behind HTTP (``rltk serve-reward PATH``).
* :mod:`rltk.rewards.judges.llm_judge`: ``llm_judge``, an LLM behind an OpenAI-compatible endpoint grades by a rubric.
* :mod:`rltk.rewards.judges.http`: the JSON POST with a timeout both call their servers with.
"""
