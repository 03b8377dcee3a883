"""The checkout these scripts sit in, first on ``sys.path``: on a GPU host its extensions are built in
place and nothing is installed, and an engine installed from another checkout must not be the one measured."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_checkout() -> str:
    """Put :data:`ROOT` first on ``sys.path`` (ahead of an editable install's entries); returns it."""
    if sys.path[:1] != [ROOT]:
        while ROOT in sys.path:
            sys.path.remove(ROOT)
        sys.path.insert(0, ROOT)
    return ROOT


def pythonpath(*extra: str) -> str:
    """A child's ``PYTHONPATH``: the checkout, ``extra`` folders, then this process's own."""
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([ROOT, *extra, *given])


def engine_origin(module: str = "engine") -> str:
    """The file ``import engine`` (or ``module``) finds in this process, or why it cannot be imported."""
    import importlib

    try:
        found = importlib.import_module(module)
    except Exception as exc:  # extensions not built yet, or no engine at all
        return f"not importable: {type(exc).__name__}: {exc}"
    return os.path.abspath(found.__file__ or "")


def from_checkout(origin: str) -> bool:
    """Whether an :func:`engine_origin` is this checkout's own engine."""
    return os.path.abspath(origin).startswith(os.path.join(ROOT, "engine") + os.sep)
