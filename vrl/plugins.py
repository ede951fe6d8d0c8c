"""Plugin discovery and the registry of environments, verifiers and reward shapers.

Plugins are found through the `vrl` entry-point group and loaded with pluggy. A plugin that fails to
import, or whose hook raises, is recorded with its error and skipped: it never takes the CLI down.
Names are registered per plugin; a name claimed twice keeps the first and records a conflict, and
`plugin:name` always reaches a specific plugin's entry.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from vrl import hookspecs
from vrl.errors import UsageError
from vrl.meta import DISTRIBUTION, version

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vrl"
BUILTIN_PLUGIN = "vrl.builtin"
KINDS = ("environments", "verifiers", "shapers")


@dataclass
class PluginInfo:
    """One plugin as `vrl plugins` shows it."""

    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    error: str | None = None
    registered: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in KINDS})


class UnknownNameError(UsageError, LookupError):
    """A name that no installed plugin registered."""


class Registry:
    """Everything plugins registered, by kind and name."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("vrl")
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self._factories: dict[str, dict[str, tuple[str, Callable[..., Any]]]] = {k: {} for k in KINDS}
        self.conflicts: list[str] = []

    # -- loading -----------------------------------------------------------------------------------
    def load(self, entry_points: bool = True) -> Registry:
        self._add_module("builtin", BUILTIN_PLUGIN, None)
        if entry_points:
            for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
                dist = ep.dist
                self._add_module(ep.name, ep.value, dist, loader=ep.load)
        for kind in KINDS:
            self._collect(kind)
        return self

    def _add_module(self, name: str, module: str, dist: Any, loader: Callable[[], Any] | None = None) -> None:
        info = PluginInfo(
            name=name,
            module=module,
            distribution=dist.metadata["Name"] if dist is not None else DISTRIBUTION,
            version=dist.version if dist is not None else version(),
        )
        if name in self.plugins:
            info.error = f"entry point name {name!r} is already used by {self.plugins[name].module}; skipped"
            self.plugins[f"{name} ({module})"] = info
            return
        self.plugins[name] = info
        try:
            obj = loader() if loader else importlib.import_module(module)
            self.pm.register(obj, name=name)
        except Exception as exc:
            info.error = _describe(exc)
            log.warning("plugin %r (%s) failed to load and was skipped: %s", name, module, info.error)

    def _collect(self, kind: str) -> None:
        caller = getattr(self.pm.hook, f"register_{kind}")
        for impl in caller.get_hookimpls():  # in registration order: builtin first, then by name
            plugin = impl.plugin_name
            info = self.plugins[plugin]

            def register(name: str, factory: Callable[..., Any], _plugin: str = plugin) -> None:
                self._register(kind, _plugin, name, factory)

            try:
                impl.function(register=register)
            except Exception as exc:
                info.error = f"register_{kind} raised {_describe(exc)}"
                log.warning("plugin %r: %s; its %s were skipped", plugin, info.error, kind)

    def _register(self, kind: str, plugin: str, name: str, factory: Callable[..., Any]) -> None:
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"invalid {kind[:-1]} name {name!r}: use a non-empty name without ':'")
        if not callable(factory):
            raise TypeError(f"{kind[:-1]} {name!r}: factory must be callable, got {type(factory).__name__}")
        table = self._factories[kind]
        self._factories[kind][f"{plugin}:{name}"] = (plugin, factory)
        if name in table:
            owner = table[name][0]
            self.conflicts.append(f"{kind[:-1]} {name!r} registered by both {owner!r} and {plugin!r}; using {owner!r}")
        else:
            table[name] = (plugin, factory)
        self.plugins[plugin].registered[kind].append(name)

    # -- lookup ------------------------------------------------------------------------------------
    def names(self, kind: str) -> list[str]:
        return sorted(n for n in self._factories[kind] if ":" not in n)

    def factory(self, kind: str, name: str) -> Callable[..., Any]:
        try:
            return self._factories[kind][name][1]
        except KeyError:
            known = ", ".join(self.names(kind)) or "none"
            hint = ""
            broken = [p.name for p in self.plugins.values() if p.error]
            if broken:
                hint = f"; plugins that failed to load: {', '.join(broken)} (see `vrl plugins`)"
            raise UnknownNameError(f"unknown {kind[:-1]} {name!r}; installed: {known}{hint}") from None

    def environment(self, name: str, **options: Any):
        """Instantiate a registered environment; its options are validated first (`OptionsError`)."""
        from vrl.environment import Environment, options_model, validate_options

        factory = self.factory("environments", name)
        model = options_model(factory)
        if model is not None:
            checked = validate_options(model, name, options)
            if getattr(factory, "Options", None) is None:
                # Checked against the signature: pass only what the user gave (coerced), so the
                # factory's own defaults apply.
                options = checked.model_dump(exclude_unset=True)
        env = factory(**options)
        if not isinstance(env, Environment):
            raise TypeError(f"environment factory {name!r} returned {type(env).__name__}, not a vrl.Environment")
        return env

    def verifier(self, name: str, **options: Any):
        return self.factory("verifiers", name)(**options)

    def shaper(self, name: str, **options: Any):
        return self.factory("shapers", name)(**options)


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" ({last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


@functools.cache
def registry() -> Registry:
    """The registry of installed plugins, loaded once per process (`registry.cache_clear()` reloads)."""
    return Registry().load()
