"""The quantized checkpoint format: ``engine.quantize_file`` writes it, ``engine.load_quantized``
reads it.

``quantize_file(src, dst, axis=0)`` streams a file, index or directory into one quantized
``.safetensors`` file (each weight ``W`` becomes int8 ``W`` plus float32 ``W.scale``, described
by the ``"engine.quantization"`` metadata key), and ``load_quantized(dst)`` reads it back as
:class:`~engine.quantize.QuantizedTensor`.  The arithmetic is :func:`engine.quantize_int8`'s;
this module sits above :mod:`engine.checkpoints.checkpoint`, which it reads and writes checkpoints with.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.apps.entry_points import open_checkpoint
from engine.base import dtypes as _dt
from engine.base._files import is_url
from engine.errors import MissingDependencyError, NonFiniteError, SerializationError, WriteError
from engine.writing.writer import open_writer

try:
    from engine.numerics.quantize import INPUTS, Int8, QuantizedTensor, quantize_array, target_dtype
except ModuleNotFoundError as exc:  # the Numba kernels: the ``kernels`` extra
    raise MissingDependencyError.of(exc, "int8 quantization (the Numba kernels)") from None

__all__ = [
    "quantize_file",
    "load_quantized",
    "QuantizeSummary",
    "QuantizedTensor",
    "METADATA_KEY",
    "SCHEME",
    "SCALE_SUFFIX",
]

#: The ``__metadata__`` key that marks a quantized file and describes its tensors.
METADATA_KEY = "engine.quantization"
#: Value of ``"scheme"`` in that record: the formula of :func:`quantize_int8`.
SCHEME = "int8-symmetric"
#: Appended to a quantized tensor's name to name its scales.
SCALE_SUFFIX = ".scale"


@dataclass(frozen=True)
class QuantizeSummary:
    """What :func:`quantize_file` wrote.

    Attributes
    ----------
    path : str
        The file written.
    quantized : tuple of str
        Tensors stored as int8 plus ``name + ".scale"``, in source order.
    copied : tuple of str
        Tensors copied unchanged, in source order.
    clamped : dict of str to (int, int, int)
        With ``on_nonfinite="clamp"``: each quantized tensor that held NaN or Inf, to its
        (NaN, +Inf, -Inf) counts.  Empty otherwise.
    bytes_in : int
        Tensor bytes read from the source (all tensors).
    bytes_out : int
        Tensor bytes written (int8 values, scales and copies; the header not counted).
    """

    path: str
    quantized: tuple[str, ...]
    copied: tuple[str, ...]
    clamped: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0

    def __str__(self) -> str:
        text = (
            f"quantized {len(self.quantized)} tensors, copied {len(self.copied)}: "
            f"{_mb(self.bytes_in)} -> {_mb(self.bytes_out)} of tensor data"
        )
        if self.clamped:
            names = ", ".join(repr(n) for n in list(self.clamped)[:5])
            more = f" and {len(self.clamped) - 5} more" if len(self.clamped) > 5 else ""
            text += f"; clamped NaN/Inf in {len(self.clamped)}: {names}{more}"
        return text


def _mb(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


class _Job(NamedTuple):
    """One source tensor and what becomes of it."""

    path: str  # the shard holding it
    name: str
    kind: str  # format dtype
    shape: tuple[int, ...]
    nbytes: int
    axis: int | None  # normalized channel axis when quantized
    quantize: bool


def quantize_file(
    src: Any,
    dst: Any,
    axis: int | None = 0,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    *,
    on_nonfinite: str = "raise",
    fsync: bool = True,
    progress: Callable[[str, int], None] | None = None,
    **options: Any,
) -> QuantizeSummary:
    """Write an int8-quantized copy of a checkpoint, one tensor at a time.

    Parameters
    ----------
    src : str or os.PathLike
        A ``.safetensors`` file, a ``*.safetensors.index.json`` with its shards, or a
        directory holding either, or a URL of any of them (as for
        :func:`engine.open_checkpoint`).
    dst : str or os.PathLike
        The ``.safetensors`` file to write: always one file (sharded output is not
        supported yet).  Written atomically: nothing appears there unless the whole file
        is complete, and a previous file there stays intact on any error.
    axis : int or None, default 0
        Channel axis of the scales: ``0`` is one scale per row (output channel) of a
        ``[out, in]`` weight; negative counts from the end; ``None`` is one scale per
        tensor.  Every selected tensor must have this axis.
    include : str or list of str, optional
        Glob patterns (:func:`fnmatch.fnmatchcase`; ``*`` also matches dots) of the names
        to quantize.  Default: every F32, F16 or BF16 tensor with at least 2 dimensions.
        Only F32/F16/BF16 tensors are ever quantized: other dtypes that match are copied.
    exclude : str or list of str, optional
        Glob patterns of names never to quantize (e.g. ``"lm_head.*"``); wins over
        ``include``.
    on_nonfinite : {"raise", "clamp"}, default "raise"
        NaN or Inf in a tensor to quantize: ``"raise"`` raises :class:`NonFiniteError`
        and writes nothing; ``"clamp"`` quantizes NaN to 0 and +-Inf to +-127 (scales from
        the finite values, as :func:`quantize_int8`) and lists the tensor in
        :attr:`QuantizeSummary.clamped` (no warning is issued).
    fsync : bool, default True
        As for :func:`engine.save_file`.
    progress : callable, optional
        Called as ``progress(name, nbytes)`` after each source tensor is written
        (``nbytes``: its size in the source).
    **options
        For a URL ``src``: ``headers``, ``timeout``, ``connections``, ... as
        :func:`engine.open_checkpoint` takes them.

    Returns
    -------
    QuantizeSummary
        Names quantized and copied, tensors clamped, tensor bytes in and out.

    Raises
    ------
    SerializationError
        Before anything is written: an output name that occurs twice (``W.scale`` is
        already a tensor of ``src`` while ``W`` is quantized), a selected tensor without
        ``axis``, or a source already carrying the ``"engine.quantization"`` metadata key.
    NonFiniteError
        A tensor to quantize holds NaN or Inf and ``on_nonfinite="raise"``; ``.tensors``
        names it, ``.path`` is its file.  Nothing is left at ``dst``.
    ValueError
        Unknown ``on_nonfinite``.
    TypeError
        ``axis`` not an int or None; patterns that are not strings.
    HeaderError, CheckpointIndexError, MissingShardError, WriteError, OSError
        As :func:`engine.open_checkpoint` and :func:`engine.open_writer` raise them.

    Notes
    -----
    The output follows the convention that :func:`load_quantized` reads: each quantized
    tensor ``W`` becomes ``W`` (I8, same shape) and ``W.scale`` (F32, shape
    ``(shape[axis],)``, or ``()`` per tensor), with ``q`` and ``scale`` exactly those of
    :func:`quantize_int8`.  Every other tensor is copied byte for byte.  ``__metadata__``
    keeps the source's (for shards: the entries all shards share) and adds
    ``"engine.quantization"``, a JSON string ``{"scheme": "int8-symmetric",
    "scale_suffix": ".scale", "tensors": {"W": {"dtype": "BF16", "axis": 0}, ...}}``
    (``axis`` normalized to be non-negative; ``null`` per tensor).

    Streaming, in bounded memory: the output header is computed from the source headers
    alone, then the tensors are processed in source order (shard by shard, file order),
    each quantized and written before the next is touched.  Copies of tensor bytes:

    - source tensors are memory-mapped views: reading them copies nothing (the kernels
      read the mapping, with no float32 copy even for F16/BF16);
    - a quantized tensor's int8 values and scales are allocated once (they are the
      output, not a copy) and written from that memory: 0 further copies;
    - a copied tensor is written straight from the mapping: 0 copies in the process.

    Peak extra memory is therefore one tensor's int8 output plus its scales plus the
    kernels' scratch (a few KiB per thread), whatever the size of the model.  The pages
    of the mapped source count in the process's resident size while it runs, but they are
    the page cache: clean, shared and reclaimed by the OS under pressure.
    """
    if is_url(dst):
        raise WriteError("the output is a URL; the int8 copy is written to a local file (upload it after)",
                         reason="LocalPathExpected", path=dst)
    spec = Int8(axis, include, exclude, on_nonfinite, embeddings=True)

    with open_checkpoint(src, **options) as ckpt:
        info = ckpt.info
        jobs = [
            _job(info.headers[shard].path or info.source, t, spec) for shard, t in info.tensors()
        ]
        metadata = _output_metadata(ckpt.metadata(), jobs, info.source)
        entries = [entry for job in jobs for entry in _entries(job)]
        _check_unique(entries, dst)

        quantized: list[str] = []
        copied: list[str] = []
        clamped: dict[str, tuple[int, int, int]] = {}
        writer = open_writer(dst, entries, metadata, fsync=fsync)
        try:
            for job in jobs:
                x = ckpt.get_tensor(job.name)
                if not job.quantize:
                    writer.write(job.name, x)
                    copied.append(job.name)
                    if progress is not None:
                        progress(job.name, job.nbytes)
                    continue
                try:
                    q, scale, bad = quantize_array(x, job.kind, job.axis, on_nonfinite == "raise", job.name, None)
                except NonFiniteError as err:
                    err.path = job.path
                    raise
                writer.write(job.name, q)
                writer.write(job.name + SCALE_SUFFIX, scale.reshape(_scale_shape(job)))
                # drop this tensor's output before the next one is quantized
                del q, scale, x
                if bad.any():
                    nan, pos, neg = (int(v) for v in bad)
                    clamped[job.name] = (nan, pos, neg)
                quantized.append(job.name)
                if progress is not None:
                    progress(job.name, job.nbytes)
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    return QuantizeSummary(
        path=os.fspath(dst),
        quantized=tuple(quantized),
        copied=tuple(copied),
        clamped=clamped,
        bytes_in=sum(job.nbytes for job in jobs),
        bytes_out=sum(_nbytes(dtype, shape) for _, dtype, shape in entries),
    )


def _job(path: str, t: Any, spec: Int8) -> _Job:
    """Decide what becomes of tensor ``t`` (a TensorInfo) of file ``path``."""
    chosen, ax = spec.select(t.name, t.dtype, tuple(t.shape), path)
    return _Job(path, t.name, t.dtype, tuple(t.shape), t.nbytes, ax, chosen)


def _scale_shape(job: _Job) -> tuple[int, ...]:
    return () if job.axis is None else (job.shape[job.axis],)


def _entries(job: _Job) -> list[tuple[str, str, tuple[int, ...]]]:
    if not job.quantize:
        return [(job.name, job.kind, job.shape)]
    return [(job.name, "I8", job.shape), (job.name + SCALE_SUFFIX, "F32", _scale_shape(job))]


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * _dt.BY_NAME[dtype].bits // 8


def _check_unique(entries: list, dst: Any) -> None:
    seen: set[str] = set()
    twice = []
    for name, _, _ in entries:
        if name in seen:
            twice.append(name)
        seen.add(name)
    if twice:
        raise SerializationError(
            f"output names collide: {', '.join(map(repr, twice[:5]))} "
            f"{'is' if len(twice) == 1 else 'are'} both a source tensor and the scales of a quantized "
            f"one ({SCALE_SUFFIX!r} suffix); rename or exclude them",
            reason="DuplicateKey",
            path=dst,
            tensors=twice,
        )


def _by_name(job: _Job) -> str:
    return job.name


def _output_metadata(source: Mapping[str, str] | None, jobs: list[_Job], src_path: str) -> dict[str, str]:
    out = dict(source or {})
    if METADATA_KEY in out:
        raise SerializationError(
            f"the source already has {METADATA_KEY!r} metadata: it is a quantized file",
            reason="AlreadyQuantized",
            path=src_path,
        )
    record = {
        "scheme": SCHEME,
        "scale_suffix": SCALE_SUFFIX,
        "tensors": {
            j.name: {"dtype": j.kind, "axis": j.axis} for j in sorted(jobs, key=_by_name) if j.quantize
        },
    }
    out[METADATA_KEY] = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    return out


def _invalid(message: str, path: str, tensors=()) -> SerializationError:
    return SerializationError(
        message + " (not a file written by engine.quantize_file?)",
        reason="InvalidQuantization",
        path=path,
        tensors=tensors,
    )


def _read_record(ckpt: Any) -> tuple[str, dict[str, tuple[str, int | None]]]:
    """Parse and check the ``engine.quantization`` record against the file's tensors.

    Returns ``(scale_suffix, {name: (original dtype, axis)})``.
    """
    path = ckpt.info.source
    metadata = ckpt.metadata() or {}
    if METADATA_KEY not in metadata:
        raise _invalid(f"no {METADATA_KEY!r} key in __metadata__", path)
    try:
        record = json.loads(metadata[METADATA_KEY])
    except ValueError as exc:
        raise _invalid(f"{METADATA_KEY!r} is not valid JSON ({exc})", path) from None
    if not isinstance(record, dict) or record.get("scheme") != SCHEME:
        scheme = record.get("scheme") if isinstance(record, dict) else None
        raise _invalid(
            f"{METADATA_KEY!r} must be an object with scheme {SCHEME!r}, got scheme {scheme!r}", path
        )
    suffix = record.get("scale_suffix")
    tensors = record.get("tensors")
    if not isinstance(suffix, str) or not suffix:
        raise _invalid(f"{METADATA_KEY!r}: scale_suffix must be a non-empty string, got {suffix!r}", path)
    if not isinstance(tensors, dict):
        raise _invalid(f"{METADATA_KEY!r}: tensors must be an object, got {type(tensors).__name__}", path)

    specs: dict[str, tuple[str, int | None]] = {}
    for name, spec in tensors.items():
        dtype = spec.get("dtype") if isinstance(spec, dict) else None
        axis = spec.get("axis", 0) if isinstance(spec, dict) else 0
        if dtype not in INPUTS or not (axis is None or (type(axis) is int and axis >= 0)):
            raise _invalid(
                f"{METADATA_KEY!r}: tensor {name!r} needs dtype F32, F16 or BF16 and axis null or "
                f"a non-negative int, got {spec!r}",
                path,
                (name,),
            )
        if name not in ckpt or name + suffix not in ckpt:
            missing = name if name not in ckpt else name + suffix
            raise _invalid(
                f"{METADATA_KEY!r} lists {name!r} but the file has no tensor {missing!r}", path, (missing,)
            )
        q, s = ckpt.info[name], ckpt.info[name + suffix]
        expected = () if axis is None else (q.shape[axis],) if axis < len(q.shape) else None
        if q.dtype != "I8" or s.dtype != "F32" or expected is None or tuple(s.shape) != expected:
            raise _invalid(
                f"tensor {name!r} is {q.dtype}{list(q.shape)} with scales {s.dtype}{list(s.shape)}; "
                f"axis {axis} needs I8 values and "
                + (f"F32{list(expected)} scales" if expected is not None else f"more than {axis} dimensions"),
                path,
                (name, name + suffix),
            )
        specs[name] = (dtype, axis)
    return suffix, specs


def load_quantized(path: Any, dequantize: bool = False, *, framework: str = "np", dtype: Any = None) -> dict:
    """Read a file written by :func:`quantize_file`.

    Parameters
    ----------
    path : str or os.PathLike
        The quantized ``.safetensors`` file (an index or directory works too).
    dequantize : bool, default False
        ``False``: quantized tensors come back as :class:`QuantizedTensor`.  ``True``: as
        :func:`dequantize_int8` of them, in ``dtype``.
    framework : {"np", "numpy", "pt", "torch"}, default "np"
        numpy arrays (``ml_dtypes.bfloat16`` for BF16) or CPU torch tensors
        (``torch.bfloat16``).
    dtype : str, numpy dtype or torch dtype, optional
        With ``dequantize=True``: ``"F32"``/``float32``, ``"F16"``/``float16`` or
        ``"BF16"``/``bfloat16`` for every quantized tensor.  Default: each tensor's
        original dtype, as recorded in the metadata.

    Returns
    -------
    dict
        Name to tensor, names sorted.  Quantized tensors appear once under their own name
        (their ``.scale`` tensors are not separate entries); every other tensor is
        returned as stored.

    Raises
    ------
    SerializationError
        The ``"engine.quantization"`` metadata is missing or malformed, or disagrees with
        the tensors (``.reason == "InvalidQuantization"``).
    TypeError
        ``dtype`` is not one of the three float types.
    HeaderError, OSError
        As :func:`engine.open_checkpoint` raises them.

    Notes
    -----
    Tensors are memory-mapped views of the file (no copy) and stay valid after the call.
    With ``dequantize=True`` each quantized tensor is allocated once in ``dtype`` and
    filled in one pass (see :func:`dequantize_int8`): the result holds the whole
    dequantized model in memory.
    """
    target = None if dtype is None else target_dtype(dtype)
    with open_checkpoint(path, framework=framework) as ckpt:
        suffix, specs = _read_record(ckpt)
        scales = {name + suffix for name in specs}
        out: dict[str, Any] = {}
        for name in ckpt.keys():
            if name in scales and name not in specs:
                continue
            x = ckpt.get_tensor(name)
            if name not in specs:
                out[name] = x
                continue
            kind, axis = specs[name]
            qt = QuantizedTensor(x, ckpt.get_tensor(name + suffix), axis, kind)
            out[name] = qt.dequantize(target) if dequantize else qt
    return out
