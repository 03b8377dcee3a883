"""Symmetric int8 quantization, per tensor or per channel.

``q, scale = engine.quantize_int8(x, axis)`` and ``engine.dequantize_int8(q, scale, axis)``.
The formula, shared bit for bit with the NumPy oracle in ``tests/naive.py``::

    amax  = max |float32(x)| over the finite values (of the tensor, or of each channel)
    scale = float32(amax) / float32(127)          # float32 division
    scale = 1 where scale == 0                    # all-zero channel (or amax < 127 * 2**-150)
    q     = int8(clip(rint(float32(x) / scale), -127, 127))   # true division, half-to-even

:class:`Int8` says which tensors of a checkpoint to quantize and how (used by the loads that
quantize as they go and by :func:`engine.quantize_file`); :class:`QuantizedTensor` is one
quantized tensor.  The quantized file format lives in :mod:`engine.apps.quantized_format`.

Importing this module imports Numba; torch only when a torch tensor is passed in.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import operator
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from engine.base import dtypes as _dt
from engine.errors import NonFiniteError, SerializationError
from engine.numerics import kernels as _k
from engine.numerics._arrays import (
    BLOCK,
    CHUNK,
    FLOAT_FORMATS,
    TILE,
    as_numpy,
    check_tunables,
    kind_of,
    normalize_axis_index,
    pieces,
    pool,
    pool_threads,
    readonly,
)

__all__ = [
    "quantize_int8",
    "dequantize_int8",
    "Int8",
    "QuantizedTensor",
    "NonFiniteError",
    "NonFiniteWarning",
]

#: Format dtypes that int8 quantization takes.
INPUTS = ("F32", "F16", "BF16")
_OUTPUTS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_ON_NONFINITE = ("raise", "clamp")


class NonFiniteWarning(RuntimeWarning):
    """Issued by ``quantize_int8(..., on_nonfinite="clamp")`` when it clamped values.

    Carries ``.name``, ``.nan_count``, ``.posinf_count`` and ``.neginf_count``.
    """

    def __init__(
        self, message: str, *, name: str | None, nan_count: int, posinf_count: int, neginf_count: int
    ):
        super().__init__(message)
        self.name = name
        self.nan_count = nan_count
        self.posinf_count = posinf_count
        self.neginf_count = neginf_count


class _Format(NamedTuple):
    """What the kernels need to know of an input format."""

    keys: _k.Keys  # bit-pattern constants, typed like the unsigned view
    fmt: int  # the kernels' format code (FLOAT for float32)
    it: np.dtype  # signed view
    ut: np.dtype  # unsigned view
    ft: np.dtype  # the float type itself
    xt: np.dtype  # the values array the kernels take: float32, or uint16 bit patterns


def _format(kind: str) -> _Format:
    it, ut, lim, ft = FLOAT_FORMATS[kind]
    sign = 1 << (np.iinfo(it).bits - 1)  # type: ignore[type-var]  # it is an integer type
    fmt = _k.F16 if kind == "F16" else _k.BF16 if kind == "BF16" else _k.FLOAT
    xt = np.dtype(ut) if fmt != _k.FLOAT else np.dtype(ft)
    return _Format(_k.Keys(ut(sign - 1), ut(lim), ut(sign)), fmt, np.dtype(it), np.dtype(ut), np.dtype(ft), xt)


_FORMATS = {kind: _format(kind) for kind in ("F32", "F16", "BF16")}


def _dims(shape: tuple, axis: int | None) -> tuple[int, int, int]:
    """(outer, channels, inner) of a C-contiguous array quantized along ``axis``."""
    if axis is None:
        return 1, 1, math.prod(shape)
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


def _grid(outer: int, C: int, inner: int, block: int, tasks: int) -> tuple[int, int, int]:
    """Task extents (oc, cc, ic) over (outer, C, inner).

    A task covers about ``block`` elements.  Along ``outer`` the tasks are capped at about
    ``tasks`` per channel group: enough to balance the pool, and it bounds the partial
    maxima (one row of C per outer task) by ~``tasks * block`` elements, whatever the shape.
    """
    if inner >= block:
        return 1, 1, block
    ic = max(inner, 1)
    cc = min(max(C, 1), max(1, block // ic))
    pc = -(-max(C, 1) // cc)
    oc = max(1, block // (cc * ic))
    oc = max(oc, -(-outer // max(1, -(-tasks // pc))))
    return max(1, min(oc, outer)), cc, ic


def _channels(key: tuple, axis: int | None):
    """Where a piece ``x[key]`` falls among the channels of ``x``.

    Returns ``(sub_axis, sel)``: quantize the piece along ``sub_axis`` (None: as one
    channel) and its channels are ``sel`` of the full channel vector (an int, a slice, or
    ``slice(None)`` for all).
    """
    if axis is None:
        return None, 0
    ints = key[:-1] if key and isinstance(key[-1], slice) else key
    k = len(ints)
    if axis < k:
        return None, key[axis]
    sub = axis - k
    if sub == 0 and len(key) > k:
        return 0, key[k]
    return sub, slice(None)


def _amax_piece(piece: np.ndarray, kind: str, sub_axis, parallel: bool, block: int, tasks: int):
    k = _FORMATS[kind]
    outer, C, inner = _dims(piece.shape, sub_axis)
    g = _k.Grid(outer, C, inner, *_grid(outer, C, inner, block, tasks))
    flat = readonly(piece.reshape(-1))
    part, bad = _k.absmax_grid(flat.view(k.it), flat.view(k.ut), k.keys, g, parallel)
    # keys are |x| bit patterns: their max is the pattern of the largest magnitude
    amax = part.max(axis=0).view(k.ft).astype(np.float32)
    return amax, bad.sum(axis=0)


def _quantize_piece(piece, kind, sub_axis, scale, out, parallel, block, tile, tasks) -> None:
    k = _FORMATS[kind]
    outer, C, inner = _dims(piece.shape, sub_axis)
    g = _k.Grid(outer, C, inner, *_grid(outer, C, inner, block, tasks))
    flat = readonly(piece.reshape(-1))
    _k.quantize_grid(k.fmt, flat.view(k.xt), scale, g, tile, out, parallel)


def _nonfinite_message(name, nan, pos, neg) -> str:
    what = f"tensor {name!r}" if name else "the tensor"
    return f"{what} holds {nan} NaN, {pos} +Inf and {neg} -Inf values"


def quantize_int8(
    x: Any,
    axis: int | None = None,
    *,
    on_nonfinite: str = "raise",
    name: str | None = None,
    threads: int | None = None,
    block: int = BLOCK,
    tile: int = TILE,
    chunk: int = CHUNK,
):
    """Quantize to symmetric int8 with float32 scales, per tensor or per channel.

    Parameters
    ----------
    x : numpy.ndarray or torch.Tensor
        F32, F16 or BF16 values (numpy ``float32``/``float16``/``ml_dtypes.bfloat16``, or
        a CPU torch tensor of those dtypes), any shape including 0-d and empty, any strides.
    axis : int, optional
        ``None`` (default): one scale for the whole tensor.  Otherwise the channel axis
        (negative counts from the end): one scale per index along it, e.g. ``axis=0`` is
        one scale per row of a matrix.
    on_nonfinite : {"raise", "clamp"}, optional
        What NaN and +-Inf in ``x`` do.  ``"raise"`` (default): raise
        :class:`NonFiniteError` (nothing is returned).  ``"clamp"``: quantize NaN to
        0, +Inf to 127 and -Inf to -127 (the scale comes from the finite values only) and
        issue a :class:`NonFiniteWarning` with the counts.
    name : str, optional
        Tensor name to put in the error or warning.
    threads, block, tile, chunk : optional
        As for :func:`engine.stats`; ``tile`` is the F16/BF16 widening unit.

    Returns
    -------
    q : numpy.ndarray of int8, shape ``x.shape``, C-contiguous
        ``clip(rint(float32(x) / scale), -127, 127)``; ``rint`` rounds half to even.
        -128 never occurs.
    scale : numpy.ndarray of float32
        Shape ``()`` for ``axis=None``, else ``(x.shape[axis],)``.  To broadcast it against
        ``q`` use ``scale.reshape([-1 if d == axis else 1 for d in range(q.ndim)])``.
        ``scale = float32(amax) / float32(127)`` with amax the largest finite magnitude of
        the tensor or channel; a channel whose scale would be 0 (all zeros, or no finite
        value, or amax below 127 * 2**-150 where the division underflows) gets scale 1 and
        all-zero ``q``.
        Both are torch tensors (sharing the same memory) when ``x`` was one.

    Raises
    ------
    NonFiniteError
        ``x`` holds NaN or Inf and ``on_nonfinite="raise"``.  Also a ``ValueError``.
    TypeError
        ``x`` is not F32, F16 or BF16 (convert float64 first: ``x.astype(np.float32)``).
    numpy.exceptions.AxisError
        ``axis`` out of range (also a ``ValueError`` and ``IndexError``).
    ValueError
        Unknown ``on_nonfinite``, or a tunable that is not a positive integer.
    DeviceError
        A torch tensor that is not on the CPU.

    Notes
    -----
    Bit-identical to the plain NumPy formula above (``tests/naive.py``): the kernels divide
    (never multiply by a reciprocal), round with ``rint`` and use no fast-math.

    Two passes over ``x``, each parallel over blocks: the first finds the maxima (on the
    integer bit patterns, which order like the magnitudes, so F16/BF16 are not widened
    and NaN/Inf are counted on the way); the second widens F16/BF16 a tile at a time in a
    per-thread scratch buffer, divides, rounds and stores int8.  When each channel is one
    contiguous run of 256 to 256 Ki bytes (``axis=0`` of a C-contiguous matrix, the usual
    per-row case) the two passes run back to back on each row while it is in cache, so
    ``x`` is read from memory once.  No float32 copy of ``x`` is made: extra memory is the
    int8 output, the scales, and per-task partial maxima (about ``4 * threads`` rows of C
    channels at most).  A non-contiguous input (or an F-ordered one) is copied piece by
    piece, about ``chunk`` elements at a time, in each pass.
    """
    check_tunables(block, tile, chunk)
    if on_nonfinite not in _ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {_ON_NONFINITE}, got {on_nonfinite!r}")
    a, is_torch = as_numpy(x)
    kind = kind_of(a.dtype, INPUTS, "quantize_int8()")
    if axis is not None:
        axis = normalize_axis_index(axis, a.ndim)
    q, scale, bad = quantize_array(a, kind, axis, on_nonfinite == "raise", name, threads, block, tile, chunk)
    if bad.any():
        _warn_clamped(bad, name)
    return _result(q, scale, axis, is_torch)


def quantize_array(a, kind, axis, raise_nonfinite, name, threads, block=BLOCK, tile=TILE, chunk=CHUNK):
    """The work of :func:`quantize_int8` on a numpy array of a checked ``kind`` and axis.

    Returns ``(q, scale, bad)`` with ``bad`` the (NaN, +Inf, -Inf) counts; raises
    NonFiniteError instead when there are any and ``raise_nonfinite`` is set (before the
    int8 output is allocated, where the passes are separate).  Never warns: callers
    report clamped values in their own way.
    """
    nchan = 1 if axis is None else a.shape[axis]

    with pool(threads, a.size, block) as parallel:
        if _fusable(a, axis):
            # one read of x: both passes per row while it sits in L2
            q = np.empty(a.shape, np.int8)
            scale, bad = _fused(a, kind, axis, q, parallel, block, tile)
            bad = _counts(bad)
            if raise_nonfinite:
                raise_if_nonfinite(bad, name)
            return q, scale, bad

        tasks = 4 * pool_threads(threads) if parallel else 1
        amax = np.zeros(nchan, np.float32)
        bad = np.zeros(3, np.int64)
        for key, piece in pieces(a, chunk, any_order=False):
            sub, sel = _channels(key, axis)
            pmax, pbad = _amax_piece(piece, kind, sub, parallel, block, tasks)
            amax[sel] = np.maximum(amax[sel], pmax if sub is not None else pmax[0])
            bad += pbad
        if raise_nonfinite:
            raise_if_nonfinite(bad, name)  # before the int8 output is allocated
        scale = amax / np.float32(127.0)
        scale[scale == 0] = np.float32(1.0)

        q = np.empty(a.shape, np.int8)
        for key, piece in pieces(a, chunk, any_order=False):
            sub, sel = _channels(key, axis)
            s = scale[sel] if sub is not None else scale[sel : sel + 1] if axis is not None else scale
            # a view: q is C-contiguous and key a prefix index (the Ellipsis keeps a 0-d
            # result an array instead of a scalar copy)
            out = q[key + (Ellipsis,)].reshape(-1)
            _quantize_piece(piece, kind, sub, np.ascontiguousarray(s), out, parallel, block, tile, tasks)
    return q, scale, bad


def _result(q, scale, axis, is_torch):
    scale = scale.reshape(()) if axis is None else scale
    if is_torch:
        import torch

        return torch.from_numpy(q), torch.from_numpy(scale)
    return q, scale


def _counts(bad) -> np.ndarray:
    """The kernels' (NaN, +Inf, -Inf) counts, summed over tasks into three int64."""
    return np.asarray(bad, dtype=np.int64).reshape(-1, 3).sum(axis=0)


def raise_if_nonfinite(bad: np.ndarray, name: str | None) -> None:
    """Raise NonFiniteError when any of the (NaN, +Inf, -Inf) counts is nonzero."""
    if not bad.any():
        return
    nan, pos, neg = (int(v) for v in bad)
    raise NonFiniteError(
        _nonfinite_message(name, nan, pos, neg)
        + "; int8 quantization needs finite values (on_nonfinite='clamp' maps NaN to 0, +-Inf to +-127)",
        tensors=[name] if name else (),
        nan_count=nan,
        posinf_count=pos,
        neginf_count=neg,
    )


def _warn_clamped(bad: np.ndarray, name: str | None) -> None:
    nan, pos, neg = (int(v) for v in bad)
    warnings.warn(
        NonFiniteWarning(
            _nonfinite_message(name, nan, pos, neg) + "; quantized NaN to 0 and +-Inf to +-127",
            name=name,
            nan_count=nan,
            posinf_count=pos,
            neginf_count=neg,
        ),
        stacklevel=3,  # the caller of quantize_int8
    )


# Rows longer than this are quantized in two separate passes (the first pass's row would no
# longer be in L2 when the second reads it: nothing gained); shorter than _FUSE_MIN, the
# per-row overhead outweighs the saved read.
_FUSE_MAX_BYTES = 256 << 10
_FUSE_MIN = 256


def _fusable(a: np.ndarray, axis: int | None) -> bool:
    """Whether per-channel quantization can run fused: each channel one contiguous row."""
    if axis is None or not (a.flags.c_contiguous and a.dtype.isnative):
        return False
    inner = math.prod(a.shape[axis + 1 :])
    return math.prod(a.shape[:axis]) == 1 and _FUSE_MIN <= inner and inner * a.itemsize <= _FUSE_MAX_BYTES


def _fused(a, kind, axis, q, parallel, block, tile):
    k = _FORMATS[kind]
    _, C, inner = _dims(a.shape, axis)
    cc = max(1, block // inner)
    flat = readonly(a.reshape(-1))
    return _k.quantize_rows_fused(k.fmt, flat.view(k.xt), flat.view(k.it), flat.view(k.ut), k.keys, C, inner, cc, tile,
                                  q.reshape(-1), parallel)


def _out_dtype(dtype) -> np.dtype:
    mod = type(dtype).__module__
    if mod == "torch" or mod.startswith("torch."):
        dt = _dt.numpy_dtype(_dt.from_torch(dtype))
    else:
        dt = np.dtype(dtype)
    if dt not in _OUTPUTS:
        raise TypeError(f"dequantize_int8() writes float32, float16 or bfloat16, not {dt}")
    return dt


def dequantize_int8(q: Any, scale: Any, axis: int | None = None, dtype: Any = np.float32):
    """Invert :func:`quantize_int8`: ``float32(q) * scale``, rounded once to ``dtype``.

    Parameters
    ----------
    q : numpy.ndarray or torch.Tensor of int8
    scale : numpy.ndarray or torch.Tensor of float32
        As returned by :func:`quantize_int8`: one element for ``axis=None``, else shape
        ``(q.shape[axis],)``.
    axis : int, optional
        The channel axis ``q`` was quantized along (``None``: per tensor).
    dtype : numpy dtype or torch dtype, optional
        ``float32`` (default), ``float16`` or ``bfloat16``.

    Returns
    -------
    numpy.ndarray or torch.Tensor
        Shape ``q.shape``, dtype ``dtype``; a torch tensor when ``q`` was one.

    Raises
    ------
    TypeError
        ``q`` is not int8, or ``dtype`` is not one of the three.
    ValueError
        ``scale`` does not match ``q`` and ``axis``.

    Notes
    -----
    The product is taken in float32 and rounded (to nearest, ties to even) once to
    ``dtype``: the same as ``(q.astype(float32) * scale).astype(dtype)``.  Only the output
    is allocated (NumPy casts through its own small buffers).

    Values within a few ulp of the float32 maximum can come back as +-Inf: ``scale`` is
    ``amax / 127`` rounded to nearest, and ``127 * scale`` may round above ``amax``.  Values
    beyond the range of a 16-bit ``dtype`` become +-Inf as in any cast.
    """
    qa, is_torch = as_numpy(q)
    sa, _ = as_numpy(scale)
    if qa.dtype != np.int8:
        raise TypeError(f"dequantize_int8() expects int8 values, got {qa.dtype}")
    sa = np.asarray(sa, dtype=np.float32)
    dt = _out_dtype(dtype)
    if axis is None:
        if sa.size != 1:
            raise ValueError(f"per-tensor dequantization needs one scale, got shape {sa.shape}")
        sb = sa.reshape(())
    else:
        axis = normalize_axis_index(axis, qa.ndim)
        if sa.shape != (qa.shape[axis],):
            raise ValueError(f"scale has shape {sa.shape}, expected ({qa.shape[axis]},) for axis {axis}")
        sb = sa.reshape([-1 if d == axis else 1 for d in range(qa.ndim)])
    out = np.empty(qa.shape, dt)
    # One ufunc call: numpy converts int8 -> float32 and float32 -> dtype in its small
    # internal buffers, so no float32 temporary of the tensor's size is made.
    np.multiply(qa, sb, out=out, dtype=np.float32, casting="unsafe")
    if is_torch:
        import torch

        if dt == np.dtype(ml_dtypes.bfloat16):
            return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(out)
    return out


def target_dtype(dtype: Any) -> np.dtype:
    """numpy dtype of a dequantization target: a format name, numpy or torch dtype."""
    if isinstance(dtype, str) and dtype in _dt.BY_NAME:
        if dtype not in INPUTS:
            raise TypeError(f"dequantization writes F32, F16 or BF16, not {dtype}")
        return _dt.numpy_dtype(_dt.code_of(dtype))
    return _out_dtype(dtype)


class QuantizedTensor(NamedTuple):
    """One tensor of a quantized file, as :func:`load_quantized` returns it.

    ``q`` (int8, the tensor's shape) and ``scale`` (float32, shape ``()`` or
    ``(shape[axis],)``) are numpy arrays or torch tensors; ``axis`` is the channel axis
    (``None``: per tensor); ``dtype`` the original format dtype (``"F32"``, ``"F16"`` or
    ``"BF16"``).
    """

    q: Any
    scale: Any
    axis: int | None
    dtype: str

    def dequantize(self, dtype: Any = None):
        """:func:`dequantize_int8` into ``dtype`` (default: the original dtype)."""
        return dequantize_int8(
            self.q, self.scale, self.axis, target_dtype(self.dtype if dtype is None else dtype)
        )


#: Names that the default selection of :class:`Int8` treats as embeddings (kept in their
#: dtype unless ``include`` names them): token and position embedding tables.
EMBEDDING_PATTERNS = ("*embed*", "*wte.*", "*wpe.*")


def _patterns(value: str | Iterable[str] | None, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    patterns = (value,) if isinstance(value, str) else tuple(value)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"{what} takes glob patterns (str or a list of str), got {bad[0]!r}")
    return patterns


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return _compiled(tuple(patterns)).match(name) is not None


@functools.lru_cache(maxsize=256)
def _compiled(patterns: tuple[str, ...]) -> re.Pattern:
    """One expression for ``fnmatchcase`` against any of ``patterns`` (tensor names are
    case-sensitive on every platform): a load asks it once per tensor."""
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns) or "(?!)")


def _check_axis(axis: Any) -> int | None:
    if axis is None:
        return None
    if isinstance(axis, bool):
        raise TypeError("axis must be an int or None, not a bool")
    try:
        return operator.index(axis)
    except TypeError:
        raise TypeError(f"axis must be an int or None, got {type(axis).__name__}") from None


@dataclass(frozen=True)
class Int8:
    """Which tensors of a checkpoint to quantize to int8, and how.

    ``engine.stream(path, quantize=Int8(axis=0))`` (or ``quantize="int8"`` for the
    defaults) takes it; :func:`engine.quantize_file` builds one from its own arguments
    (with embeddings included).

    Parameters
    ----------
    axis : int or None, default 0
        Channel axis of the scales: ``0`` is one scale per row (output channel) of an
        ``[out, in]`` weight; negative counts from the end; ``None`` is one scale per
        tensor.  Every selected tensor must have this axis.
    include : str or list of str, optional
        Glob patterns (:func:`fnmatch.fnmatchcase`; ``*`` also matches dots) of the names
        to quantize.  Default: every F32, F16 or BF16 tensor with at least 2 dimensions
        (so never a norm or a bias), except embeddings unless ``embeddings=True``.  Only
        F32/F16/BF16 tensors are ever quantized: other dtypes that match are left as they are.
    exclude : str or list of str, optional
        Glob patterns of names never to quantize (e.g. ``"lm_head.*"``); wins over
        ``include``.
    on_nonfinite : {"raise", "clamp"}, default "raise"
        NaN or Inf in a tensor to quantize: raise :class:`NonFiniteError`, or quantize NaN
        to 0 and +-Inf to +-127 as :func:`quantize_int8` does.
    embeddings : bool, default False
        Whether the default selection takes tensors named like embedding tables
        (:data:`EMBEDDING_PATTERNS`).  Ignored when ``include`` is given.

    Raises
    ------
    TypeError
        ``axis`` not an int or None; patterns that are not strings.
    ValueError
        Unknown ``on_nonfinite``.
    """

    axis: int | None = 0
    include: str | Iterable[str] | None = None
    exclude: str | Iterable[str] | None = None
    on_nonfinite: str = "raise"
    embeddings: bool = False

    def __post_init__(self) -> None:
        if self.on_nonfinite not in _ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {_ON_NONFINITE}, got {self.on_nonfinite!r}")
        object.__setattr__(self, "axis", _check_axis(self.axis))
        object.__setattr__(self, "include", _patterns(self.include, "include"))
        object.__setattr__(self, "exclude", _patterns(self.exclude, "exclude"))

    @classmethod
    def of(cls, spec: Any) -> Int8 | None:
        """The spec a ``quantize=`` argument names: None, ``"int8"`` or an :class:`Int8`."""
        if spec is None or isinstance(spec, Int8):
            return spec
        if spec == "int8":
            return cls()
        raise ValueError(f"quantize must be None, 'int8' or an engine.quantize.Int8, got {spec!r}")

    def select(self, name: str, kind: str, shape: tuple, path: Any = None) -> tuple[bool, int | None]:
        """Whether tensor ``name`` (format dtype ``kind``, ``shape``) is quantized, and its
        normalized channel axis (None: per tensor, or not quantized).

        Raises :class:`~engine.errors.SerializationError` (``reason="InvalidAxis"``) when a
        selected tensor has no such axis.
        """
        floating = kind in INPUTS
        if self.include is None:
            chosen = floating and len(shape) >= 2 and (self.embeddings or not _matches(name, EMBEDDING_PATTERNS))
        else:
            chosen = floating and _matches(name, self.include)
        if chosen and self.exclude is not None and _matches(name, self.exclude):
            chosen = False
        if not chosen or self.axis is None:
            return chosen, None
        ndim = len(shape)
        if not -ndim <= self.axis < ndim:
            raise SerializationError(
                f"tensor {name!r} of shape {list(shape)} has no axis {self.axis}; choose another axis, "
                "axis=None (per tensor), or exclude it",
                reason="InvalidAxis",
                path=path,
                tensors=(name,),
            )
        return True, self.axis % ndim
