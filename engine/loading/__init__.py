"""loading: see ARCHITECTURE.md.

The package itself holds a load's ``framework=`` (the floor's front door, as the sinks' package
holds ``get_sink``): the names the reference spells (``"np"``, ``"pt"``, ...), the kind of sink each
asks for (:func:`engine.sinks.get_sink` makes it) and the sink itself.  Here rather than in a module
of its own because a handle checks its framework at open: a first open loads this package anyway,
and imports no sink module (they come with the first tensor).
"""

from __future__ import annotations

from typing import Any

__all__ = ["sink_kind", "sink_for", "get_sink"]


#: framework name -> the kind of sink it asks for (:func:`engine.sinks.get_sink`)
_FRAMEWORKS = {
    "np": "numpy",
    "numpy": "numpy",
    "pt": "torch",
    "torch": "torch",
    "cp": "cupy",
    "cupy": "cupy",
}

#: Frameworks the reference accepts at open and imports at the first tensor (``"paddle"``
#: at open): name -> the module it needs.  The engine opens such a file, lists its names,
#: dtypes, shapes and metadata, and refuses the tensors (see
#: :class:`engine.sinks.unsupported.UnsupportedSink`).
_UNSUPPORTED = {
    "tf": "tensorflow",
    "tensorflow": "tensorflow",
    "flax": "jax",
    "jax": "jax",
    "mlx": "mlx",
    "paddle": "paddle",
}
_IMPORTED_AT_OPEN = ("paddle",)


def sink_kind(framework: str, device="cpu") -> str:
    """``"numpy"``, ``"torch"`` or ``"cupy"`` for a framework name as the reference spells it
    (``"np"``, ``"pt"``, ...), checked without importing the framework.

    Raises ``SafetensorError`` for an unknown name and ``DeviceError`` for numpy on a device
    other than the CPU.
    """
    if isinstance(framework, str) and framework in _UNSUPPORTED:
        return "unsupported"
    try:
        kind = _FRAMEWORKS[framework]
    except (KeyError, TypeError):
        from engine.errors import SafetensorError

        raise SafetensorError(
            f"unsupported framework {framework!r}; expected one of {sorted(_FRAMEWORKS)}",
            reason="InvalidFramework",
        ) from None
    if kind == "numpy" and str(device) != "cpu":
        from engine.errors import DeviceError

        raise DeviceError(f"numpy arrays live on the CPU; device {device!r} needs framework='pt'")
    return kind


def get_sink(kind: str, device: Any = "cpu"):
    """:func:`engine.sinks.get_sink`, imported by the first sink: a first open needs none."""
    from engine.sinks import get_sink as make

    return make(kind, device)


def sink_for(framework: str, device: Any = "cpu"):
    """The sink of ``framework`` (:func:`sink_kind`, then :func:`engine.sinks.get_sink`); a
    framework that is not installed is a :class:`~engine.errors.MissingDependencyError` naming
    the feature, the extra and the install line."""
    kind = sink_kind(framework, device)
    if kind == "unsupported":
        from engine.sinks.unsupported import UnsupportedSink

        return UnsupportedSink(framework, _UNSUPPORTED[framework], imported_at_open=framework in _IMPORTED_AT_OPEN)
    try:
        return get_sink(kind, device)
    except ModuleNotFoundError as exc:
        from engine.errors import MissingDependencyError

        raise MissingDependencyError.for_framework(exc, framework) from None
