"""What the commands, the dashboard and recipe scripts know about recipes, without running one.

* :mod:`~rltk.recipe_tools.validation`: a recipe's stages from the registry, its config checked against what they
  provide (``rltk validate``, ``rltk run`` before it hands over, :func:`rltk.recipes.parse_recipe_args`).
* :mod:`~rltk.recipe_tools.recipe_utils`: the old home of what recipe scripts import, kept for one release.
"""
