"""rltk's own components declared on their own, registered through rltk's entry points like a plugin's.

* :mod:`~rltk.components.builtin_stages`: rltk's training loops (sft, grpo, ppo, distill, dpo, reward_model) as
  stages (:class:`rltk.StageSpec`), with what each provides and refuses; importing it imports no training code.
"""
