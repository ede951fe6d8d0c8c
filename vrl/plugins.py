"""Plugin discovery and the registries filled through the hooks of `vrl.hookspecs`.

Plugins are found through the `vrl` entry-point group and loaded with pluggy; `vrl.builtin` (vrl's
own environments, update rules, backends, runtimes and commands) is registered first, through the
same hooks. A plugin that fails to import, implements a hook that does not exist (a typo), or whose
hook raises, is recorded with its error and skipped: it never takes the CLI down.

Names are registered per plugin; a name claimed twice keeps the first and records a conflict, and
`plugin:name` always reaches a specific plugin's entry. Each kind is collected the first time a name
of that kind is needed, so `vrl --help` calls no registration hook but `register_commands`.

`VRL_PLUGINS` limits which entry points load, for hermetic runs: unset, every installed plugin;
`VRL_PLUGINS=lean,python-tests`, those entry-point names only; `VRL_PLUGINS=` (empty), none: the
built-ins alone.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata as md
import logging
import os
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from vrl import hookspecs
from vrl.errors import UsageError
from vrl.meta import DISTRIBUTION, version

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vrl"
BUILTIN_PLUGIN = "vrl.builtin"
PLUGINS_ENV = "VRL_PLUGINS"
#: What each registration hook fills, in the order `vrl plugins` lists them (singular, for messages).
KINDS: dict[str, str] = {
    "environments": "environment",
    "optimizers": "optimizer",
    "generators": "generator backend",
    "runtimes": "runtime",
}
HOOKS = tuple(f"register_{kind}" for kind in KINDS) + ("register_commands",)
#: Hooks that existed once, with what replaced them (named in the error of a plugin that still has one).
REMOVED_HOOKS = {
    "register_verifiers": "an Environment returns its verifier from `verifier()`; register the environment",
    "register_shapers": "an Environment returns its reward shaper from `shaper()` (compose shapers there: "
                        "`Binary() + 0.1 * FormatBonus(...)`)",
}


@dataclass
class PluginInfo:
    """One plugin as `vrl plugins` shows it."""

    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    error: str | None = None
    registered: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in (*KINDS, "commands")})


class UnknownNameError(UsageError, LookupError):
    """A name that no installed plugin registered."""


class Registry:
    """Everything plugins registered, by kind and name."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("vrl")
        self.pm.add_hookspecs(hookspecs)
        self._plugins: dict[str, PluginInfo] = {}  # `plugins` shows them once every kind is collected
        self._factories: dict[str, dict[str, tuple[str, Any]]] = {k: {} for k in KINDS}
        self._collected: set[str] = set()
        # One thread collects a kind while the others wait: the pool's hosts look names up side by side, and
        # a kind marked collected before its hooks have run would look empty to them.
        self._collecting = threading.RLock()
        self._done: set[str] = set()
        self._conflicts: list[str] = []
        self._warned: set[str] = set()

    # -- loading -----------------------------------------------------------------------------------
    def load(self, entry_points: bool = True, plugins: Mapping[str, Any] | None = None) -> Registry:
        """Register the built-in plugin, the installed entry points (as `VRL_PLUGINS` allows) and
        `plugins` (name -> module or object with hookimpls: how tests add one without installing it)."""
        self._add("builtin", BUILTIN_PLUGIN, None)
        if entry_points:
            found = sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
            wanted = _wanted(os.environ.get(PLUGINS_ENV))
            for ep in found:
                if wanted is None or ep.name in wanted:
                    self._add(ep.name, ep.value, ep.dist, loader=ep.load)
            for name in sorted((wanted or set()) - {ep.name for ep in found}):
                installed = ", ".join(ep.name for ep in found) or "none"
                self._plugins[name] = PluginInfo(name=name, module="", error=f"{PLUGINS_ENV} names {name!r}, which is "
                                                f"not installed (installed: {installed})")
        for name, obj in (plugins or {}).items():
            self._add(name, getattr(obj, "__name__", type(obj).__name__), None, loader=lambda obj=obj: obj)
        return self

    def _add(self, name: str, module: str, dist: Any, loader: Callable[[], Any] | None = None) -> None:
        info = PluginInfo(
            name=name,
            module=module,
            distribution=dist.metadata["Name"] if dist is not None else DISTRIBUTION,
            version=dist.version if dist is not None else version(),
        )
        if name in self._plugins:
            info.error = f"entry point name {name!r} is already used by {self._plugins[name].module}; skipped"
            self._plugins[f"{name} ({module})"] = info
            return
        self._plugins[name] = info
        try:
            obj = loader() if loader else importlib.import_module(module)
            self.pm.register(obj, name=name)
            self._check_hooks(name)
        except Exception as exc:
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            info.error = _describe(exc)
            self._warn(name, exc)

    def _warn(self, plugin: str, exc: BaseException) -> None:
        """One short warning line per failed plugin and registry (that is, per command); `vrl plugins` has the error."""
        if plugin in self._warned:
            return
        self._warned.add(plugin)
        log.warning("plugin %r failed (%s) and was skipped; `vrl plugins` shows the error", plugin, type(exc).__name__)

    def _check_hooks(self, name: str) -> None:
        """pluggy's `check_pending`: every hookimpl of the plugin just registered has a hookspec; a
        typo is an error that names the plugin and the hook (and what was meant)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError:
            plugin = self.pm.get_plugin(name)
            unknown = sorted(c.name for c in self.pm.get_hookcallers(plugin) or () if not c.has_spec())
            if not unknown:
                raise
            hook = unknown[0]
            if hook in REMOVED_HOOKS:
                raise PluginHookError(f"plugin {name!r} implements {hook}, which vrl no longer has: "
                                      f"{REMOVED_HOOKS[hook]}") from None
            close = difflib.get_close_matches(hook, HOOKS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PluginHookError(f"plugin {name!r} implements unknown hook {hook!r}; {hint}vrl's hooks: "
                                  f"{', '.join(HOOKS)}") from None

    # -- collecting a kind -------------------------------------------------------------------------
    def _collect(self, kind: str) -> None:
        if kind in self._done:
            return
        with self._collecting:
            if kind in self._collected:  # done, or being collected by this thread (a hook looking names up)
                return
            self._collected.add(kind)
            self._collect_now(kind)
            self._done.add(kind)

    def _collect_now(self, kind: str) -> None:
        caller = getattr(self.pm.hook, f"register_{kind}")
        for impl in caller.get_hookimpls():  # in registration order: builtin first, then by name
            plugin = impl.plugin_name
            info = self._plugins[plugin]

            def register(name: str, obj: Any, _plugin: str = plugin) -> None:
                self._register(kind, _plugin, name, obj)

            try:
                impl.function(register=register)
            except Exception as exc:
                error = f"register_{kind} raised {_describe(exc)}"
                info.error = f"{info.error}; {error}" if info.error else error
                self._warn(plugin, exc)

    def _register(self, kind: str, plugin: str, name: str, obj: Any) -> None:
        what = KINDS[kind]
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"invalid {what} name {name!r}: use a non-empty name without ':'")
        if kind == "environments":
            if not callable(obj):
                raise TypeError(f"{what} {name!r}: factory must be callable, got {type(obj).__name__}")
        elif not (isinstance(obj, type) and _is_model(getattr(obj, "Config", None))):
            raise TypeError(f"{what} {name!r}: register a class whose `Config` is a pydantic model (its config "
                            f"section), got {obj!r}")
        table = self._factories[kind]
        table[f"{plugin}:{name}"] = (plugin, obj)
        if name in table:
            owner = table[name][0]
            self._conflicts.append(f"{what} {name!r} registered by both {owner!r} and {plugin!r}; using {owner!r}")
        else:
            table[name] = (plugin, obj)
        self._plugins[plugin].registered[kind].append(name)

    @property
    def conflicts(self) -> list[str]:
        """Names claimed twice (the first claim is kept): calls every registration hook first."""
        self.collect_all()
        return self._conflicts

    @property
    def plugins(self) -> dict[str, PluginInfo]:
        """Every plugin (loaded or failed), with what it registered: calls every registration hook first."""
        return self.collect_all()._plugins

    def collect_all(self) -> Registry:
        """Call every registration hook now (what `vrl plugins` shows)."""
        for kind in KINDS:
            self._collect(kind)
        return self

    # -- lookup ------------------------------------------------------------------------------------
    def names(self, kind: str) -> list[str]:
        self._collect(kind)
        return sorted(n for n in self._factories[kind] if ":" not in n)

    def factory(self, kind: str, name: str) -> Any:
        """What a plugin registered as `name` (or `plugin:name`); `UnknownNameError` lists the names there are."""
        self._collect(kind)
        try:
            return self._factories[kind][name][1]
        except KeyError:
            raise UnknownNameError(self.unknown(kind, name)) from None

    def subclass(self, kind: str, name: str, base: type, what: str) -> Any:
        """`factory(kind, name)`, which must be a subclass of `base` (`what` names it in the error:
        "optimizer", "runtime", "generator backend")."""
        cls = self.factory(kind, name)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            shown = getattr(cls, "__qualname__", repr(cls))
            raise TypeError(f"{what} {name!r} is registered as {shown}, which is not a vrl.{base.__name__}")
        return cls

    def unknown(self, kind: str, name: str) -> str:
        """One line: the name is not registered, what is, and which plugins failed to load."""
        known = ", ".join(self.names(kind)) or "none"
        hint = ""
        broken = [p.name for p in self._plugins.values() if p.error]
        if broken:
            hint = f"; plugins that failed to load: {', '.join(broken)} (see `vrl plugins`)"
        return f"unknown {KINDS[kind]} {name!r}; installed: {known}{hint}"

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

    # -- commands ----------------------------------------------------------------------------------
    def add_commands(self, cli: Any) -> None:
        """Call every plugin's `register_commands(cli)`; a name already taken keeps its first owner,
        and a plugin whose hook raises adds nothing."""
        for impl in self.pm.hook.register_commands.get_hookimpls():
            plugin = impl.plugin_name
            info = self._plugins[plugin]
            before = dict(cli.commands)
            try:
                impl.function(cli=cli)
            except Exception as exc:
                cli.commands.clear()
                cli.commands.update(before)
                error = f"register_commands raised {_describe(exc)}"
                info.error = f"{info.error}; {error}" if info.error else error
                self._warn(plugin, exc)
                continue
            for name, command in list(cli.commands.items()):
                if name in before and command is not before[name]:
                    cli.commands[name] = before[name]
                    self._conflicts.append(f"command {name!r} of plugin {plugin!r} is already taken; kept the first")
                elif name not in before:
                    info.registered["commands"].append(name)


class PluginHookError(UsageError, ValueError):
    """A plugin implements a hook that vrl does not have."""


def _wanted(value: str | None) -> set[str] | None:
    """The entry-point names `VRL_PLUGINS` lets load (None: all)."""
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def _is_model(obj: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" ({last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


@functools.cache
def registry() -> Registry:
    """The registry of installed plugins, loaded once per process (`registry.cache_clear()` reloads)."""
    return Registry().load()


def environment_wire(environment: Any, config: Any, where: str, fix: str) -> dict[str, Any]:
    """What `where` (the hosts of another process or machine) builds the run's environment from, to run
    episodes beside their engines: the run's plugin and options, since an environment object does not
    travel. An environment that is not the plugin's (made in code and handed to the Trainer) is refused
    in one line ending with `fix`."""
    factory = registry().factory("environments", config.plugin)
    if isinstance(factory, type) and type(environment) is not factory:
        raise UsageError(f"{where} build their environment from the run's config (plugin {config.plugin!r}), but "
                         f"this run's is a {type(environment).__name__} made in code: register it in a plugin "
                         f"(docs/plugins.md), or {fix}")
    return {"plugin": config.plugin, "env_options": dict(config.env_options)}


def environment_from_wire(wire: dict[str, Any]) -> Any:
    """The environment `environment_wire` describes, built here from its plugin."""
    return registry().environment(wire["plugin"], **wire["env_options"])
