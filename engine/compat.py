"""Make ``import safetensors`` resolve to the engine for every library in the process.

:func:`install` puts a module standing for ``safetensors`` into ``sys.modules`` and a finder
at the front of ``sys.meta_path``; from then on ``import safetensors``, ``import
safetensors.torch`` and ``import safetensors.numpy`` give the engine, whoever imports them
(transformers, diffusers, accelerate, huggingface_hub, vLLM, ...).  :func:`uninstall` puts
back exactly the ``safetensors`` entries of ``sys.modules`` that were there before (the
reference's modules if they had been imported, nothing if they had not) and removes the
finder.  :func:`installed` is the context manager doing both.

What it reaches and what it cannot
----------------------------------
Every ``import`` statement executed after :func:`install`.  A library that ran ``from
safetensors import safe_open`` (or ``import safetensors.torch``) *before* :func:`install`
holds the reference's objects in its own globals, and keeps calling them: install the shim
first thing in the process, before importing the libraries.  Rebinding other libraries'
globals is deliberately not attempted: aliases in closures, default arguments and class
attributes cannot be found, and a half-switched library is worse than a reported one.
:func:`bound_to_reference` lists the module globals still holding the reference's objects,
and :func:`install` warns with that list when it is not empty.

``importlib.metadata.version("safetensors")`` keeps reading the installed distribution's
metadata; the shim does not (and cannot cleanly) change it.  Libraries that check the
distribution at import (transformers requires ``safetensors>=0.8``) need the reference
package installed, even though none of its code runs under the shim.

Importing this module imports neither torch nor numba: ``engine.torch`` is imported the
first time ``safetensors.torch`` is.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
import warnings
from collections.abc import Iterator

import engine

__all__ = [
    "REFERENCE_VERSION",
    "install",
    "uninstall",
    "installed",
    "is_installed",
    "bound_to_reference",
]

#: The ``safetensors.__version__`` the shim reports: the reference release whose Python API
#: the engine implements.  Libraries compare this string against minimum versions (for
#: example huggingface_hub refuses below 0.4.3), so it names the API level, not the engine's
#: own version, which is ``safetensors.__engine_version__``.
REFERENCE_VERSION = "0.8.0"

_PACKAGE = "safetensors"

#: The reference's top-level names, each served by the engine's object of the same name.
_TOP_LEVEL = (
    "safe_open",
    "SafetensorError",
    "serialize",
    "serialize_file",
    "deserialize",
    "TensorSpec",
    "_safe_open_handle",
)

#: Submodules the engine stands in for; any other ``safetensors.*`` is refused.
_SUBMODULES = {
    "safetensors.torch": "engine.torch",
    "safetensors.numpy": "engine.numpy",
}

_lock = threading.RLock()
#: While installed: the ``safetensors`` entries of ``sys.modules`` found at install time.
_saved: dict[str, types.ModuleType] | None = None
_package: types.ModuleType | None = None


def _owned(module_name: str) -> bool:
    return module_name == _PACKAGE or module_name.startswith(_PACKAGE + ".")


class _Loader(importlib.abc.Loader):
    """Hands out the shim package and the engine's modules under the reference's names.

    ``exec_module`` replaces the placeholder module the import system made with the real
    one in ``sys.modules``; the import system then returns that entry.  Returning
    ``engine.torch`` from ``create_module`` instead would make the import system overwrite
    ``engine.torch.__spec__`` with the ``safetensors.torch`` spec.
    """

    def create_module(self, spec):
        return None  # the default placeholder; exec_module swaps it out

    def exec_module(self, module):
        name = module.__spec__.name
        if name == _PACKAGE:
            target = _package
            if target is None:  # uninstalled between find_spec and exec_module
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        else:
            target = importlib.import_module(_SUBMODULES[name])
        sys.modules[name] = target


class _Finder(importlib.abc.MetaPathFinder):
    """Resolves ``safetensors`` and its submodules while the shim is installed."""

    def find_spec(self, fullname, path=None, target=None):
        if not _owned(fullname):
            return None
        if fullname == _PACKAGE:
            return importlib.machinery.ModuleSpec(fullname, _LOADER, is_package=True)
        if fullname in _SUBMODULES:
            return importlib.machinery.ModuleSpec(fullname, _LOADER)
        raise ModuleNotFoundError(
            f"{fullname!r} is not available while engine.compat is installed: the engine stands in "
            f"for {', '.join([_PACKAGE, *_SUBMODULES])} only; call engine.compat.uninstall() "
            f"before importing {fullname!r} to use the reference package",
            name=fullname,
        )


_LOADER = _Loader()
_FINDER = _Finder()


def _make_package() -> types.ModuleType:
    """The module object that stands for ``safetensors``.

    A package (``__path__ == []``) so that ``import safetensors.torch`` asks the finders,
    whose first is ours.  The reference's top-level names resolve on first access from
    ``engine``, so that building the shim imports nothing beyond ``engine`` itself.
    """
    spec = importlib.machinery.ModuleSpec(_PACKAGE, _LOADER, is_package=True)
    package = importlib.util.module_from_spec(spec)

    def __getattr__(name: str):
        if name not in _TOP_LEVEL:
            raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")
        value = getattr(engine, name)
        setattr(package, name, value)
        return value

    def __dir__():
        return sorted(set(vars(package)) | set(_TOP_LEVEL))

    vars(package).update(
        __doc__="safetensors, served by safetensors-engine (engine.compat).",
        __version__=REFERENCE_VERSION,
        __engine_version__=engine.__version__,
        __all__=[name for name in _TOP_LEVEL if not name.startswith("_")],
        __getattr__=__getattr__,
        __dir__=__dir__,
    )
    return package


def _reference_objects(modules: dict[str, types.ModuleType]) -> dict[int, str]:
    """id -> dotted name of the reference's modules, functions and classes among ``modules``."""
    found: dict[int, str] = {}
    for module_name, module in modules.items():
        found[id(module)] = module_name
        for name, value in list(vars(module).items()):
            if name.startswith("__") or not callable(value):
                continue
            origin = getattr(value, "__module__", None) or ""
            # the Rust extension's classes report __module__ "builtins": tell them from real builtins
            from_reference = _owned(origin) or (
                origin == "builtins" and getattr(builtins, getattr(value, "__name__", ""), None) is not value
            )
            if from_reference:
                found.setdefault(id(value), f"{module_name}.{name}")
    return found


def _scan(reference: dict[int, str]) -> list[str]:
    """``"module.attribute"`` for every module global (outside safetensors) bound to ``reference``."""
    hits = []
    seen: set[int] = set()
    for module_name, module in list(sys.modules.items()):
        # one module can sit under two names (``__main__`` and ``__mp_main__``): report it once
        if _owned(module_name) or module is None or id(module) in seen:
            continue
        seen.add(id(module))
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if id(value) in reference:
                hits.append(f"{module_name}.{name}")
    return sorted(hits)


def bound_to_reference() -> list[str]:
    """Module globals that still hold the reference package's objects.

    Only meaningful while the shim is installed and the reference had been imported before
    :func:`install`: those are the places the shim cannot reach (a ``from safetensors import
    safe_open`` or ``import safetensors.torch`` that ran before :func:`install`).

    Returns
    -------
    list of str
        ``"module.attribute"`` names, sorted; empty when nothing is bound to the reference
        or the shim is not installed.

    Notes
    -----
    Scans the namespace of every module in ``sys.modules`` once: milliseconds for a few
    thousand modules.
    """
    with _lock:
        if not _saved:
            return []
        return _scan(_reference_objects(_saved))


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _saved is not None


def install(*, warn: bool = True) -> bool:
    """Make ``safetensors``, ``safetensors.torch`` and ``safetensors.numpy`` the engine's.

    Parameters
    ----------
    warn : bool, default True
        Warn (``RuntimeWarning``) when modules imported before this call hold the
        reference's objects, which the shim cannot reach (see :func:`bound_to_reference`).

    Returns
    -------
    bool
        True if this call installed the shim, False if it was already installed (then
        nothing changes: calls do not nest, see :func:`installed`).

    Notes
    -----
    Under the shim, ``import safetensors`` gives a module whose ``safe_open``,
    ``SafetensorError``, ``serialize``, ``serialize_file``, ``deserialize``, ``TensorSpec``
    and ``_safe_open_handle`` are the engine's objects and whose ``__version__`` is
    :data:`REFERENCE_VERSION`; ``safetensors.torch`` is ``engine.torch`` and
    ``safetensors.numpy`` is ``engine.numpy`` (the same module objects), which serve the
    reference's public names of those modules, ``TensorSpec``, ``serialize``,
    ``serialize_file`` and ``deserialize`` included.  Any other
    submodule (``safetensors.flax``, ``safetensors.tensorflow``, ...) raises
    ``ModuleNotFoundError`` saying so.  The reference's modules, if imported, are kept
    aside unchanged and put back by :func:`uninstall`.
    """
    global _saved, _package
    with _lock:
        if _saved is not None:
            return False
        saved = {name: module for name, module in sys.modules.items() if _owned(name)}
        for name in saved:
            del sys.modules[name]
        # a fresh module per install: nothing imported under an earlier install lingers on it
        _package = _make_package()
        sys.modules[_PACKAGE] = _package
        sys.meta_path.insert(0, _FINDER)
        _saved = saved
        if warn and saved:
            stale = _scan(_reference_objects(saved))
            if stale:
                shown = ", ".join(stale[:10]) + (f" and {len(stale) - 10} more" if len(stale) > 10 else "")
                warnings.warn(
                    f"engine.compat.install(): {len(stale)} module globals were bound to the reference "
                    f"safetensors before install() and keep using it: {shown}. Call install() before "
                    "importing the libraries that use safetensors.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return True


def uninstall() -> bool:
    """Undo :func:`install`: put back exactly the ``safetensors`` modules that were there.

    Returns
    -------
    bool
        True if the shim was installed and is now removed, False if it was not installed.

    Notes
    -----
    Every ``safetensors`` and ``safetensors.*`` entry of ``sys.modules`` is removed and the
    entries saved by :func:`install` are put back (none, if the reference had not been
    imported: the next ``import safetensors`` then imports it).  Modules that imported the
    shim while it was installed keep the objects they bound, which are the engine's.
    """
    global _saved, _package
    with _lock:
        if _saved is None:
            return False
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(_FINDER)
        for name in [name for name in sys.modules if _owned(name)]:
            del sys.modules[name]
        sys.modules.update(_saved)
        _saved = None
        _package = None
        return True


@contextlib.contextmanager
def installed(*, warn: bool = True) -> Iterator[types.ModuleType]:
    """Context manager: the shim is installed inside the block, and removed after it.

    Yields the module standing for ``safetensors``.  If the shim was already installed on
    entry, it stays installed on exit, so blocks nest.

    Examples
    --------
    >>> import engine.compat
    >>> with engine.compat.installed():
    ...     import safetensors
    ...     safetensors.safe_open is engine.safe_open
    True
    """
    mine = install(warn=warn)
    try:
        yield sys.modules[_PACKAGE]
    finally:
        if mine:
            uninstall()
