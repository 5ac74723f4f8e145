"""Plugins: hookspecs, the plugin registry and backend selection.

Hooks are for discovery and configuration only (which backends and models exist, extra CLI args,
engine start/stop notices). Per-step work goes to the one selected Accelerator object, never
through `pm.hook`. Built-in backends register through the same entry point group as third-party
ones, so the code path that finds `cpu` is the one that finds a plugin.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import pluggy

from deepinfer.core.accelerator import Accelerator
from deepinfer.core.config import accelerator_from_env

PROJECT = "deepinfer"
ENTRY_POINT_GROUP = "deepinfer"
# Registered directly as well, so that a source checkout that was never pip-installed (and so
# has no entry points) still finds its own backends; their own entry points are then skipped.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("cpu", "deepinfer.backends.cpu.plugin"), ("nvidia", "deepinfer.backends.cuda.plugin"),
    ("neuron", "deepinfer.backends.neuron.plugin"))

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class AcceleratorInfo:
    """A backend as a plugin announces it; `load` imports the class lazily so that a backend
    whose dependencies are missing is reported rather than breaking start-up."""

    name: str
    load: Callable[[], type[Accelerator]]
    aliases: tuple[str, ...] = ()
    priority: int = 0  # probe order when no backend is requested: higher first
    description: str = ""
    # Environment of rank r of world w (the rank processes of this host), set in the rank process
    # before the backend is imported: e.g. the device cores each rank owns. Given the inherited
    # environment; called in the API process, which must not import the backend itself.
    rank_env: Callable[[int, int, Mapping[str, str]], dict[str, str]] | None = None
    # A cheap check that needs no import of the backend: None where it can run here, else why
    # not and what to install. Without it the class is loaded and asked (is_available): a
    # backend whose module imports its kernels (Triton's) makes every start on a machine
    # without its device pay that import.
    probe: Callable[[], str | None] | None = None

    def unavailable(self) -> str | None:
        """Why this backend cannot run here (None: it can), loading it only if it has no
        probe of its own."""
        if self.probe is not None:
            return self.probe()
        cls = self.load()
        return None if cls.is_available() else cls.unavailable_reason()

    def matches(self, name: str) -> bool:
        wanted = name.strip().lower()
        return wanted == self.name.lower() or wanted in (a.lower() for a in self.aliases)


@dataclass(frozen=True)
class PluginFailure:
    name: str
    error: str


@dataclass(frozen=True)
class AcceleratorRow:
    name: str
    aliases: tuple[str, ...]
    priority: int
    status: str  # "available", "unavailable" or "failed: <reason>"
    description: str
    why_unavailable: str = ""  # the backend's own account of what is missing


class AcceleratorError(RuntimeError):
    """A requested backend exists but cannot be used (import failed, or not available here)."""


class Hookspecs:
    @hookspec
    def deepinfer_register_accelerators(self) -> list[AcceleratorInfo]:
        """Backends this plugin provides."""
        raise NotImplementedError  # a hook specification: plugins implement it

    @hookspec
    def deepinfer_register_models(self) -> dict[str, str]:
        """HF architecture name (config.json "architectures") -> "module:Class" import path."""
        raise NotImplementedError  # a hook specification: plugins implement it

    @hookspec
    def deepinfer_add_cli_args(self, parser: argparse.ArgumentParser) -> None:
        """Add plugin-specific options to a command's parser."""

    @hookspec
    def deepinfer_engine_started(self, config: Any) -> None:
        """The engine is ready (config: the EngineConfig)."""

    @hookspec
    def deepinfer_engine_stopped(self, config: Any) -> None:
        """The engine has shut down."""


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class PluginRegistry:
    """A pluggy PluginManager plus the failures met while loading and calling plugins.

    Every hook is called one implementation at a time so that one broken plugin is recorded in
    `failures` instead of taking the others (and the engine) down with it.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(Hookspecs)
        self.failures: list[PluginFailure] = []

    def register(self, plugin: object, name: str | None = None) -> bool:
        """Register a module or object holding hookimpls; False (and a failure) if it is
        rejected."""
        if self.pm.is_registered(plugin):
            return True
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy validation, or a name already taken by another plugin
            self.report(name or repr(plugin), _error_text(exc))
            return False
        return True

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        for ep in importlib.metadata.entry_points(group=group):
            seen = self.pm.get_plugin(ep.name)
            if seen is not None and getattr(seen, "__name__", None) == ep.value:
                continue  # the same distribution seen twice on sys.path
            try:
                plugin = ep.load()
            except Exception as exc:  # a third party's import error must not stop start-up
                self.report(ep.name, _error_text(exc))
                continue
            self.register(plugin, name=ep.name)

    def load_builtins(self) -> None:
        for name, module_name in BUILTIN_PLUGINS:
            if self.pm.has_plugin(name):
                continue
            try:
                self.register(importlib.import_module(module_name), name=name)
            except Exception as exc:
                self.report(name, _error_text(exc))

    def call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """(plugin name, result) of each implementation, in registration order."""
        caller = getattr(self.pm.hook, hook_name)
        results = []
        for impl in caller.get_hookimpls():
            if impl.hookwrapper or impl.wrapper:
                continue  # wrappers only make sense inside pm.hook's own call loop
            try:
                result = impl.function(*(kwargs[arg] for arg in impl.argnames))
            except Exception as exc:
                self.report(impl.plugin_name, f"{hook_name}: {_error_text(exc)}")
                continue
            if result is not None:
                results.append((impl.plugin_name, result))
        return results

    def accelerators(self) -> list[AcceleratorInfo]:
        """Every announced backend; on a name clash the first registered plugin wins."""
        found: dict[str, AcceleratorInfo] = {}
        for plugin_name, infos in self.call_each("deepinfer_register_accelerators"):
            for info in infos if isinstance(infos, (list, tuple)) else [infos]:
                if not isinstance(info, AcceleratorInfo):
                    self.report(plugin_name, f"not an AcceleratorInfo: {info!r}")
                elif info.name.lower() in found:
                    self.report(plugin_name, f"accelerator {info.name!r} is already registered")
                else:
                    found[info.name.lower()] = info
        return list(found.values())

    def models(self) -> dict[str, str]:
        """HF architecture -> "module:Class"; on a clash the first registered plugin wins."""
        merged: dict[str, str] = {}
        for plugin_name, mapping in self.call_each("deepinfer_register_models"):
            if not isinstance(mapping, dict):
                self.report(plugin_name, f"deepinfer_register_models returned {mapping!r}")
                continue
            for arch, path in mapping.items():
                merged.setdefault(arch, path)
        return merged

    def add_cli_args(self, parser: argparse.ArgumentParser) -> None:
        self.call_each("deepinfer_add_cli_args", parser=parser)

    def engine_started(self, config: Any) -> None:
        self.call_each("deepinfer_engine_started", config=config)

    def engine_stopped(self, config: Any) -> None:
        self.call_each("deepinfer_engine_stopped", config=config)

    def report(self, name: str, error: str) -> None:
        """Record a failure once: accelerators() runs more than once (select, describe)."""
        failure = PluginFailure(name, error)
        if failure not in self.failures:
            self.failures.append(failure)


def load_plugins(group: str = ENTRY_POINT_GROUP) -> PluginRegistry:
    """A fresh registry with every installed plugin (entry points) and the built-in backends."""
    registry = PluginRegistry()
    registry.load_builtins()  # first, so that no plugin can take over a built-in's names
    registry.load_entry_points(group)
    return registry


def _summary(registry: PluginRegistry, infos: list[AcceleratorInfo]) -> str:
    names = ", ".join(i.name + (f" ({', '.join(i.aliases)})" if i.aliases else "") for i in infos)
    text = f"available: {names or 'none'}"
    if registry.failures:
        text += "; failed plugins: " + "; ".join(f"{f.name}: {f.error}" for f in registry.failures)
    return text


def find_accelerator(infos: list[AcceleratorInfo], name: str) -> AcceleratorInfo | None:
    """The backend `name` names, or None: an exact name beats another backend's alias."""
    wanted = name.strip().lower()
    return next((i for i in infos if i.name.lower() == wanted),
                next((i for i in infos if i.matches(name)), None))


def choose_accelerator(registry: PluginRegistry, name: str | None = None) -> AcceleratorInfo:
    """The backend named by `name` or DEEPINFER_ACCELERATOR, else the first available by
    priority; its class is loaded here, so a backend that cannot run fails now."""
    requested = name or accelerator_from_env()
    return _named(registry, requested) if requested else _first_available(registry)


def select_accelerator(registry: PluginRegistry, name: str | None = None) -> type[Accelerator]:
    """The class of the backend choose_accelerator picks."""
    return choose_accelerator(registry, name).load()


def load_accelerator(registry: PluginRegistry, name: str) -> type[Accelerator]:
    """The class of a backend already chosen, by its name: no probing, no other backend asked
    (a rank loads what the server chose)."""
    infos = registry.accelerators()
    info = find_accelerator(infos, name)
    if info is None:
        raise ValueError(f"unknown accelerator {name!r}; {_summary(registry, infos)}")
    try:
        return info.load()
    except Exception as exc:
        raise AcceleratorError(
            f"accelerator {info.name!r} failed to load: {_error_text(exc)}") from exc


def _named(registry: PluginRegistry, requested: str) -> AcceleratorInfo:
    infos = registry.accelerators()
    info = find_accelerator(infos, requested)
    if info is None:
        raise ValueError(f"unknown accelerator {requested!r}; {_summary(registry, infos)}")
    try:
        why = info.unavailable()
        if why is None:
            info.load()
    except Exception as exc:
        raise AcceleratorError(
            f"accelerator {info.name!r} failed to load: {_error_text(exc)}") from exc
    if why is not None:
        raise AcceleratorError(f"accelerator {info.name!r} is not available on this "
                               f"machine: {why}")
    return info


def _first_available(registry: PluginRegistry) -> AcceleratorInfo:
    infos = registry.accelerators()
    for info in sorted(infos, key=lambda i: -i.priority):  # stable: ties keep registration order
        try:
            if info.unavailable() is None:
                info.load()
                log.info("selected accelerator %r (priority %d)", info.name, info.priority)
                return info
        except Exception as exc:  # reported, then the next backend is probed
            registry.report(info.name, _error_text(exc))
            log.warning("accelerator %r failed to load: %s", info.name, _error_text(exc))
    raise AcceleratorError(f"no accelerator is available; {_summary(registry, infos)}")


def describe(registry: PluginRegistry) -> list[AcceleratorRow]:
    """One row per backend, highest priority first, for `deepinfer plugins`."""
    rows = []
    for info in sorted(registry.accelerators(), key=lambda i: -i.priority):
        try:
            why = info.unavailable() or ""
            if not why:
                info.load()  # available, and its module imports
            status = "unavailable" if why else "available"
        except Exception as exc:
            status, why = f"failed: {_error_text(exc)}", ""
        rows.append(AcceleratorRow(info.name, info.aliases, info.priority, status,
                                   info.description, why))
    return rows
