"""The one error hierarchy of the engine.

Every class derives from :class:`SafetensorError` and from the builtin exception that
callers already catch (``ValueError``, ``KeyError``, ``OSError``, ...), so code written
against the reference ``safetensors`` package keeps working.  ``.reason`` carries the
reference implementation's error name where one exists (``HeaderTooLarge``,
``InvalidOffset``, ``MetadataIncompleteBuffer``, ...), so that callers can branch on the
kind of defect without parsing messages.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

__all__ = [
    "SafetensorError",
    "HeaderError",
    "TensorNotFoundError",
    "SerializationError",
    "SerializationTypeError",
    "ReadError",
    "WriteError",
    "DeviceError",
    "MissingDependencyError",
    "TensorMismatchError",
    "NonFiniteError",
    "SharedTensorsError",
    "UnrepresentableTensorError",
    "InvalidSliceError",
    "Cancelled",
    "ConfigError",
    "CheckpointIndexError",
    "MissingShardError",
    "RemoteFileNotFoundError",
    "ShardingError",
    "UnsupportedFrameworkError",
    "DeviceFallbackWarning",
    "HEADER_REASONS",
]

#: Every ``.reason`` a :class:`HeaderError` can carry.  The first group are the reference
#: implementation's names; the rest are checks the reference does not make.
HEADER_REASONS = frozenset(
    {
        "HeaderTooSmall",
        "HeaderTooLarge",
        "InvalidHeaderLength",
        "InvalidHeader",  # header bytes are not valid UTF-8
        "InvalidHeaderStart",
        "InvalidHeaderDeserialization",  # not JSON, or JSON of the wrong shape
        "TensorInvalidInfo",
        "InvalidOffset",
        "MetadataIncompleteBuffer",
        "ValidationOverflow",
        "MisalignedSlice",
        # stricter than the reference
        "DuplicateKey",
        "InvalidDtype",
        "NotSafetensors",  # a Git LFS pointer, an HTML page, JSON or text, not safetensors at all
    }
)


class SafetensorError(Exception):
    """Base class of every error the engine raises.

    Parameters
    ----------
    message : str
        What went wrong, in words.
    reason : str, optional
        Machine-readable kind of failure; for header defects the reference's name.
    path : str or os.PathLike, optional
        The file involved.  Can be set after construction by a caller that knows it.
    tensors : iterable of str, optional
        Names of the tensors involved.
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        path: str | os.PathLike[str] | None = None,
        tensors: Iterable[str] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.path = os.fspath(path) if path is not None else None
        self.tensors = tuple(tensors)

    def __str__(self) -> str:
        # KeyError's own __str__ would repr() the message; every subclass shows plain text.
        prefix = f"{self.path}: " if self.path else ""
        suffix = f" [{self.reason}]" if self.reason else ""
        return f"{prefix}{self.message}{suffix}"

    def __reduce__(self):  # keep errors picklable across worker processes
        return (
            _rebuild,
            (type(self), self.message, self.__dict__.copy()),
        )


def _rebuild(cls, message, state):
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class HeaderError(SafetensorError, ValueError):
    """The header violates a rule of the format.

    ``.reason`` is one of :data:`HEADER_REASONS`; ``.position`` is the byte offset inside
    the header (counted from the first byte after the 8-byte length) where the parser
    stopped, or ``None`` when the defect is not tied to one place.
    """

    def __init__(self, message: str, *, reason: str, position: int | None = None, **kw) -> None:
        super().__init__(message, reason=reason, **kw)
        self.position = position


class TensorNotFoundError(SafetensorError, KeyError):
    """A tensor name that the file does not hold."""

    #: difflib compares the missing name with every name; above this many it is not cheap
    SUGGEST_LIMIT = 20_000

    @classmethod
    def for_name(cls, name: object, names, *, where: str, path=None) -> TensorNotFoundError:
        """The error for a missing ``name``, suggesting the closest of ``names`` when cheap."""
        import difflib

        hint = ""
        if isinstance(name, str) and len(names) <= cls.SUGGEST_LIMIT:
            close = difflib.get_close_matches(name, list(names), n=1)
            if close:
                hint = f"; did you mean {close[0]!r}?"
        return cls(f"no tensor named {name!r} in the {where}{hint}", reason="TensorNotFound", path=path,
                   tensors=(str(name),))


class SerializationError(SafetensorError, ValueError):
    """Tensors or metadata that cannot be written (non-contiguous, shared memory, bad names)."""


class SerializationTypeError(SerializationError, TypeError):
    """Metadata or a tensor name of the wrong type: metadata that is not a mapping of str to
    str, a tensor name that is not a str.

    A ``TypeError`` as well, as the reference raises for the same arguments, so that
    callers' ``except TypeError`` keeps catching it.
    """


class SharedTensorsError(SerializationError, RuntimeError):
    """Tensors to save share memory.

    A ``RuntimeError`` as well, as the reference raises for the same case, so that callers'
    ``except RuntimeError`` keeps catching it; ``.tensors`` names every tensor involved.
    """


class UnrepresentableTensorError(SafetensorError, ValueError, TypeError):
    """A valid header entry whose tensor the framework cannot build.

    The header opens and ``get_slice(name).get_shape()`` works; only materialising the
    tensor fails, for example a rank above numpy's limit of 64 dimensions or a dimension
    beyond the 63 bits torch and numpy index with.  A ``ValueError`` and a ``TypeError``,
    which numpy and torch raise for such shapes.
    """


class ReadError(SafetensorError, OSError):
    """Reading tensor bytes failed: I/O error, short read, file changed underneath.

    Carries ``.offset`` and ``.size`` of the failed request, counted in bytes from the start
    of the file.
    """

    def __init__(self, message: str, *, offset: int | None = None, size: int | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.offset = offset
        self.size = size


class WriteError(SafetensorError, OSError):
    """Writing a file failed; any previous file at the destination is left intact."""


class DeviceError(SafetensorError, RuntimeError):
    """A device was asked for that is not there or cannot be used."""


class MissingDependencyError(SafetensorError, ImportError):
    """An optional dependency is needed; the message names the extra to install."""

    def __init__(self, package: str, extra: str, feature: str) -> None:
        super().__init__(
            f"{feature} needs {package}; install it with `pip install safetensors-engine[{extra}]`",
            reason="MissingDependency",
        )
        self.name = package


class TensorMismatchError(SafetensorError, ValueError):
    """A destination tensor does not match the file's tensor (shape, dtype, layout)."""


class NonFiniteError(SafetensorError, ValueError):
    """A tensor to quantize holds NaN or infinite values.

    ``.tensors`` names the tensor (when a ``name`` was given); ``.nan_count``,
    ``.posinf_count`` and ``.neginf_count`` say how many of each.
    """

    def __init__(
        self, message: str, *, nan_count: int = 0, posinf_count: int = 0, neginf_count: int = 0, **kw
    ):
        kw.setdefault("reason", "NonFinite")
        super().__init__(message, **kw)
        self.nan_count = nan_count
        self.posinf_count = posinf_count
        self.neginf_count = neginf_count


class InvalidSliceError(SafetensorError, IndexError):
    """An index that does not fit the tensor (out of range, wrong type, too many dims)."""


class Cancelled(SafetensorError):
    """The load was stopped by its consumer (an early ``break`` out of ``stream()``)."""


class ConfigError(SafetensorError, ValueError):
    """A config.json that is missing keys or holds impossible values."""


class CheckpointIndexError(SafetensorError, ValueError):
    """The index of a sharded checkpoint breaks a rule, or disagrees with its shards.

    ``.reason`` is one of ``InvalidIndex`` (not JSON, not an object, ``weight_map`` missing
    or not a mapping of str to str, duplicate keys, too large), ``UnsafeShardName`` (a shard
    name with ``..``, an absolute path or a URL), ``TensorNotInShard`` (listed in the index,
    absent from its shard), ``TensorNotInIndex`` (in a shard, not listed for it) or
    ``DuplicateTensor`` (the same name in two shards).  ``.path`` is the index (or the
    shard), ``.tensors`` the names involved.
    """


class _MissingFile(ReadError, FileNotFoundError):
    """A file that is not there: a ``ReadError`` and a ``FileNotFoundError`` (``errno.ENOENT``)."""

    _reason = "NotFound"

    def __init__(self, message: str, **kw) -> None:
        super().__init__(message, reason=kw.pop("reason", self._reason), **kw)
        self.errno = errno.ENOENT
        self.strerror = os.strerror(errno.ENOENT)


class MissingShardError(_MissingFile):
    """A shard that the index names does not exist.  Also a ``FileNotFoundError``."""

    _reason = "MissingShard"


class RemoteFileNotFoundError(_MissingFile):
    """The server answered 404 (or 410), or the fsspec file system has no such file.

    ``.reason`` is ``"NotFound"``; also a ``FileNotFoundError`` (``errno.ENOENT``).
    """


class ShardingError(SafetensorError, ValueError):
    """A tensor that the plan cannot split as asked (uneven, bad dimension, bad fused sizes)."""


class UnsupportedFrameworkError(SafetensorError, ModuleNotFoundError):
    """A framework the reference serves and the engine does not (``"tf"``, ``"flax"``,
    ``"mlx"``, ``"paddle"``); raised where the reference would import that framework, and a
    ``ModuleNotFoundError`` as the reference's error there is.  ``.name`` is the module."""

    def __init__(self, message: str, *, name: str, **kw) -> None:
        kw.setdefault("reason", "UnsupportedFramework")
        super().__init__(message, **kw)
        self.name = name


class DeviceFallbackWarning(RuntimeWarning):
    """Not an error: work meant for the device ran elsewhere, with the same results.

    Issued once per process where Numba's CUDA target cannot work (no NVVM, a driver it
    does not know): statistics of a load to a GPU are then folded on the CPU from the
    staging slots, and int8 quantization runs on the CPU kernels, the results copied back
    to the device.  ``warnings.simplefilter("error", DeviceFallbackWarning)`` makes it fatal.
    """
