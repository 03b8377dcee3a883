"""The sink of a framework the reference accepts and the engine does not serve (TensorFlow,
JAX/Flax, MLX, Paddle): a file opens and lists its names, dtypes, shapes and metadata, and
every tensor is refused with the reference's kind of error.
"""

from __future__ import annotations

from engine.errors import UnsupportedFrameworkError

__all__ = ["UnsupportedSink"]


class UnsupportedSink:
    """The sink of a framework the engine does not serve: every use raises.

    Its error comes where the reference's would, at the first tensor (for ``"paddle"`` when
    the sink is made, at open, if paddle is not installed), and is a ``ModuleNotFoundError``
    as the reference's is when the framework is missing.
    """

    def __init__(self, framework: str, module: str, *, imported_at_open: bool = False) -> None:
        self._framework = framework
        self._module = module  # what the reference imports for it
        if imported_at_open and not _installed(module):
            raise self._error()

    def _error(self) -> UnsupportedFrameworkError:
        found = "is installed" if _installed(self._module) else "is not installed"
        return UnsupportedFrameworkError(
            f"framework {self._framework!r} needs {self._module} ({self._module} {found}); the engine hands out "
            "numpy, torch and CuPy tensors only: open with framework='np' and convert the arrays",
            name=self._module,
        )

    def __getattr__(self, name: str):
        raise self._error()


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
