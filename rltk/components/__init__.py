"""How rltk's own components are registered without importing them (so ``rltk validate`` starts without torch).

:mod:`rltk.components.source` reads a builtin registration module's ``rltk_*`` hooks and each component's
signature from its source, where the reading is exact; the registry imports a component only when it is used.
"""
