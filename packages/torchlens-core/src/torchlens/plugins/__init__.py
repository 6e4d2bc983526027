"""Plugins: pluggy hookspecs and the entry-point plugin manager."""

from torchlens.plugins.hookspecs import hookimpl, hookspec
from torchlens.plugins.manager import DISABLE_ENV, ENTRY_POINT_GROUPS, PluginInfo, PluginManager, get_plugin_manager

__all__ = ["hookimpl", "hookspec", "PluginManager", "PluginInfo", "get_plugin_manager", "ENTRY_POINT_GROUPS", "DISABLE_ENV"]
