"""What the registry is made of below :mod:`rltk.registry`, importing nothing heavy.

* :mod:`~rltk.registration.source`: rltk's builtin registration modules and each component's signature read from
  their source, where the reading is exact, so the registry imports a component only when it is used (``rltk
  validate`` starts without torch).
* :mod:`~rltk.registration.stage_spec`: :class:`rltk.StageSpec`, a training loop as a registered component.
"""
