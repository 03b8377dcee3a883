"""The checkout these scripts belong to, first on ``sys.path``.

scripts/gpu_check.py, scripts/bench_gpu.py, scripts/ring_sweep.py and the child processes
they start import the engine of the checkout they sit in: on a GPU host its extensions are
built in place (``python setup.py build_ext --inplace``) and nothing is installed, and where
another copy of the engine is installed (an editable install of another checkout) it must
not be the one measured.  :func:`engine_origin` says which one a process imported.
"""

from __future__ import annotations

import os
import sys

#: the checkout's root: the folder above scripts/
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_checkout() -> str:
    """Put :data:`ROOT` first on ``sys.path`` (ahead of site-packages and of an editable
    install's path entries); returns it."""
    if sys.path[:1] != [ROOT]:
        while ROOT in sys.path:
            sys.path.remove(ROOT)
        sys.path.insert(0, ROOT)
    return ROOT


def pythonpath(*extra: str) -> str:
    """A ``PYTHONPATH`` for child processes: the checkout, ``extra`` folders, then what this
    process was given."""
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([ROOT, *extra, *given])


def engine_origin(module: str = "engine") -> str:
    """The file that ``import engine`` (or ``module``, such as ``engine.gpu._ring``) finds in this
    process, or why it cannot be imported (an exception's type and text)."""
    import importlib

    try:
        found = importlib.import_module(module)
    except Exception as exc:  # a checkout whose extensions are not built yet, or no engine at all
        return f"not importable: {type(exc).__name__}: {exc}"
    return os.path.abspath(found.__file__ or "")


def from_checkout(origin: str) -> bool:
    """Whether an :func:`engine_origin` is this checkout's own engine."""
    return os.path.abspath(origin).startswith(os.path.join(ROOT, "engine") + os.sep)
