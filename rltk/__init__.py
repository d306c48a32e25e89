"""rltk: composable reinforcement-learning components for LLM post-training."""

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

from rltk.stage_spec import StageSpec

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
