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
    "DistributedLoadError",
    "WriteError",
    "DeviceError",
    "MissingDependencyError",
    "EXTRA_OF",
    "install_line",
    "TensorMismatchError",
    "NonFiniteError",
    "ChecksumError",
    "SharedTensorsError",
    "UnrepresentableTensorError",
    "InvalidSliceError",
    "Cancelled",
    "ConfigError",
    "OptionError",
    "CheckpointIndexError",
    "MissingShardError",
    "RemoteFileNotFoundError",
    "ShardingError",
    "UnsupportedFrameworkError",
    "DeviceFallbackWarning",
    "CacheWriteWarning",
    "RangeIgnoredWarning",
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
        # ImportError's ``.name`` lives in a slot, not in ``__dict__``
        name = self.name if isinstance(self, ImportError) else None
        return (
            _rebuild,
            (type(self), self.message, self.__dict__.copy(), name),
        )


def _rebuild(cls, message, state, name=None):
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    if name is not None:
        err.name = name
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


class DistributedLoadError(ReadError):
    """A load shared by the ranks of a process group failed; raised on every rank of the group.

    ``.reason`` is ``"GroupReadFailed"`` (a rank failed to open, read or check its share:
    ``.rank`` is that rank in the group, ``.cause`` its error in words; on that rank the error is
    also the ``__cause__``), ``"GroupMismatch"`` (the ranks were given different checkpoints or
    options) or ``"GroupFailed"`` (a rank died or left during the load; ``.cause``: the
    backend's words).
    """

    def __init__(self, message: str, *, rank: int | None = None, cause: str | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.rank = rank
        self.cause = cause


class WriteError(SafetensorError, OSError):
    """Writing a file failed; any previous file at the destination is left intact."""


class DeviceError(SafetensorError, RuntimeError):
    """A device was asked for that is not there or cannot be used."""


#: the optional extra that brings each package the engine imports on demand (numba's
#: kernels also need llvmlite, which numba installs)
EXTRA_OF = {
    # the core's own dependencies: no extra, the install itself brings them
    "numpy": "",
    "ml_dtypes": "",
    "numba": "kernels",
    "llvmlite": "kernels",
    "torch": "torch",
    "cupy": "cupy",
    "fsspec": "remote",
    "botocore": "s3",
    "tqdm": "cli",
}


def install_line(extra: str) -> str:
    """The command that installs ``extra`` (``""``: the engine itself, with the dependencies of
    its core), in the form that works for this installation.

    A checkout (an editable install, or the source tree on ``sys.path``: the folder above the
    package holds this project's ``pyproject.toml``) gets ``pip install -e ".[extra]"``, with
    the checkout's path when the working directory is elsewhere: that is how the README
    installs the engine, and a name on a package index may not be this checkout at all.
    Anything else (a wheel) gets ``pip install "safetensors-engine[extra]"``.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            checkout = 'name = "safetensors-engine"' in f.read()
    except OSError:
        checkout = False
    extras = f"[{extra}]" if extra else ""
    if not checkout:
        return f'pip install "safetensors-engine{extras}"'
    try:
        here = os.path.samefile(os.getcwd(), root)
    except OSError:
        here = False
    return f'pip install -e "{"." if here else root}{extras}"'


class MissingDependencyError(SafetensorError, ModuleNotFoundError):
    """A dependency is needed and not installed: an optional one (an extra's), or one of
    the core's that a broken environment lacks.

    Raised at the moment the feature that needs it is used (never by ``import engine``);
    the message names the feature, the package and the command that installs the extra
    (:func:`install_line`).  A ``ModuleNotFoundError`` (so an ``ImportError``) as well, the
    error it stands for, so callers' ``except ModuleNotFoundError`` keeps catching it; ``.name`` is the missing package, ``.extra`` the extra, ``.feature`` what
    needed it.

    Parameters
    ----------
    package : str
        The module that is missing (``"numba"``).
    extra : str
        The extra of this project that installs it (``"kernels"``; ``""`` for the core's own
        dependencies, numpy and ml_dtypes).
    feature : str
        What needs it, in words a user recognises (``"engine.stats"``, ``"engine stats"``).
    """

    def __init__(self, package: str, extra: str, feature: str) -> None:
        what = f"install the {extra!r} extra" if extra else "it comes with the engine's own install"
        super().__init__(
            f"{feature} needs {package}, which is not installed; {what}: {install_line(extra)}",
            reason="MissingDependency",
        )
        self.name = package
        self.extra = extra
        self.feature = feature

    @classmethod
    def of(cls, exc: ImportError, feature: str) -> ImportError:
        """The error to raise for ``exc``, an import that failed while ``feature`` needed it:
        a :class:`MissingDependencyError` when the missing module belongs to one of the
        extras (:data:`EXTRA_OF`), else ``exc`` itself (a broken install is not a missing
        extra)."""
        if isinstance(exc, MissingDependencyError):
            return exc
        package = (getattr(exc, "name", None) or "").partition(".")[0]
        extra = EXTRA_OF.get(package)
        if extra is None or not isinstance(exc, ModuleNotFoundError):
            return exc
        # llvmlite comes with numba: name the package the user knows and installs
        return cls("numba" if package == "llvmlite" else package, extra, feature)

    @classmethod
    def for_framework(cls, exc: ImportError, framework: str) -> ImportError:
        """:meth:`of` for a ``framework=`` whose package is missing (torch by default in
        ``engine.stream`` and ``engine.torch``)."""
        if framework in ("pt", "torch"):
            feature = f"framework={framework!r} (torch tensors; framework='np' gives numpy arrays without torch)"
        else:
            feature = f"framework={framework!r}"
        return cls.of(exc, feature)


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


class ChecksumError(SafetensorError, ValueError):
    """A tensor's bytes do not match the checksum its file records, or the record itself is
    malformed.

    ``.reason`` is ``"ChecksumMismatch"`` (``.tensors`` names the tensor; ``.expected`` and
    ``.computed`` are the CRC-32C values as ints) or ``"InvalidChecksums"`` (the
    ``__metadata__`` entry cannot be read; ``.expected`` and ``.computed`` are None).
    """

    def __init__(self, message: str, *, expected: int | None = None, computed: int | None = None, **kw) -> None:
        kw.setdefault("reason", "ChecksumMismatch")
        super().__init__(message, **kw)
        self.expected = expected
        self.computed = computed


class InvalidSliceError(SafetensorError, IndexError):
    """An index that does not fit the tensor (out of range, wrong type, too many dims)."""


class Cancelled(SafetensorError):
    """The load was stopped by its consumer (an early ``break`` out of ``stream()``)."""


class ConfigError(SafetensorError, ValueError):
    """A config.json that is missing keys or holds impossible values."""


class OptionError(SafetensorError, ValueError):
    """An option that a loader does not know, or a value it cannot take (an inference
    server's ``--model-loader-extra-config``); ``.option`` names the option."""

    def __init__(self, message: str, *, option: str, **kw) -> None:
        super().__init__(message, reason=kw.pop("reason", "InvalidOption"), **kw)
        self.option = option


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

    Issued once per process where Numba's CUDA target cannot work (no numba-cuda, no NVVM, a
    driver it does not know), naming the cause and the fix: statistics and int8 quantization
    of a torch or CuPy load to a GPU then run as that framework's own operations on the
    device (``engine.numerics._device_fallback``); other device sinks fold statistics on the
    CPU from the file's bytes and quantize with the CPU kernels, the results copied back.
    ``warnings.simplefilter("error", DeviceFallbackWarning)`` makes it fatal.
    """


class CacheWriteWarning(RuntimeWarning):
    """Not an error: a load's local copy (``cache_dir``) could not be written (a full disk, an
    I/O error), or cannot be made at all (a server that tells no versions apart), so that
    file gets no copy; the load itself goes on and its tensors are whole.  Issued once per
    file, naming it and the cause.
    ``warnings.simplefilter("error", CacheWriteWarning)`` makes it fatal.
    """


class RangeIgnoredWarning(RuntimeWarning):
    """Not an error: a server answered a ranged GET with the whole file (200), as
    ``python -m http.server`` does, so that file is read as one sequential stream instead of
    parallel ranges (one connection's speed), and the bytes a load passes before it asks for
    them are kept in a temporary file.  Issued once per file, naming the server.
    ``warnings.simplefilter("error", RangeIgnoredWarning)`` makes it fatal.
    """
