"""Policy plugins: a user's own policies, registered by importing a module.

A plugin is a Python file or an importable module whose top level registers policies with a
family's registry (``@REGISTRY.register("name")`` on a subclass of the family's base class,
as the built-in policies do). Plugins come from ``--plugin FILE_OR_MODULE`` on the commands
that resolve policies (``moesim run``, ``sweep``, ``compare``, ``mrc``, ``policies``), from
:func:`load_plugins` in Python, and from other installed distributions through the
entry-point group ``moesim.plugins`` (each entry point names a module; moesim imports it when
the command line starts). Sweep and compare workers load the same plugins before they run a
point.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path

from moesim.errors import MoesimError

GROUP = "moesim.plugins"
_loaded: list[str] = []  # the specs loaded in this process, in order (handed to sweep workers)


def loaded_plugins() -> list[str]:
    """The plugin specs (resolved file paths or module names) loaded in this process."""
    return list(_loaded)


def _import_file(path: Path) -> None:
    name = f"moesim_plugin_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise MoesimError(f"plugin {path}: not a Python file; give a .py file or a module name.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except MoesimError as exc:
        del sys.modules[name]
        raise MoesimError(f"plugin {path}: {exc}") from None
    except Exception as exc:
        del sys.modules[name]
        raise MoesimError(f"plugin {path} failed while importing: {type(exc).__name__}: {exc}. "
                          "Fix the plugin (run `python FILE` to see the traceback).") from None


def load_plugin(spec: str) -> None:
    """Import one plugin: a ``.py`` file (relative to the working directory) or a module name.
    Loading the same plugin again does nothing."""
    path = Path(spec)
    is_file = spec.endswith(".py") or path.is_file()
    key = str(path.resolve()) if is_file else spec
    if key in _loaded:
        return
    if is_file:
        if not path.is_file():
            raise MoesimError(f"plugin {spec}: no such file; give a .py file or an importable module name.")
        _import_file(path.resolve())
    else:
        try:
            importlib.import_module(spec)
        except ModuleNotFoundError as exc:
            raise MoesimError(f"plugin {spec}: no module named {exc.name!r}; give a .py file or an importable "
                              "module name (on PYTHONPATH or installed).") from None
        except Exception as exc:
            raise MoesimError(f"plugin {spec} failed while importing: {type(exc).__name__}: {exc}.") from None
    _loaded.append(key)


def load_plugins(specs: Iterable[str] = (), installed: bool = True) -> list[str]:
    """Import the plugins ``specs`` and, with ``installed``, every module registered under
    the entry-point group ``moesim.plugins``; returns the plugins loaded so far."""
    if installed:
        for ep in entry_points(group=GROUP):
            load_plugin(ep.value.split(":")[0])
    for spec in specs:
        load_plugin(spec)
    return loaded_plugins()
