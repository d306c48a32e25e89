"""rltk: composable reinforcement-learning components for LLM post-training."""

from rltk.notices import alias_moved_modules

# The top level keeps the modules most code imports; the others moved into packages by concern (issue 55). Their
# old names import the module in its new place with a DeprecationWarning, for one release: one alias each here,
# no file left behind.
alias_moved_modules({
    "rltk.cli": "rltk.commands.cli",
    "rltk.serve_command": "rltk.commands.serve",
    "rltk.produce_command": "rltk.commands.produce",
    "rltk.stage_spec": "rltk.registration.stage_spec",
    "rltk.builtin_stages": "rltk.components.builtin_stages",
    "rltk.recipe_validation": "rltk.recipe_tools.validation",
    "rltk.recipe_utils": "rltk.recipe_tools.recipe_utils",
})

from rltk.registry import (
    ComponentTable,
    LifecycleHookError,
    RegistryError,
    PluginLoadError,
    call_lifecycle_hook,
    get_component,
    get_plugin_manager,
    hookimpl,
    list_components,
    override,
    register_plugin,
    unregister_plugin,
)

from rltk.registration.stage_spec import StageSpec

__version__ = "0.1.0"

__all__ = [
    "ComponentTable",
    "LifecycleHookError",
    "RegistryError",
    "StageSpec",
    "PluginLoadError",
    "call_lifecycle_hook",
    "get_component",
    "get_plugin_manager",
    "hookimpl",
    "list_components",
    "override",
    "register_plugin",
    "unregister_plugin",
    "__version__",
]
