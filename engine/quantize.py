"""Symmetric int8 quantization, per tensor or per channel.

``q, scale = engine.quantize_int8(x, axis)`` and ``engine.dequantize_int8(q, scale, axis)``.
The formula, shared bit for bit with the NumPy oracle in ``tests/naive.py``::

    amax  = max |float32(x)| over the finite values (of the tensor, or of each channel)
    scale = float32(amax) / float32(127)          # float32 division
    scale = 1 where scale == 0                    # all-zero channel (or amax < 127 * 2**-150)
    q     = int8(clip(rint(float32(x) / scale), -127, 127))   # true division, half-to-even

Importing this module imports Numba; torch only when a torch tensor is passed in.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from . import dtypes as _dt
from . import kernels as _k
from .errors import NonFiniteError
from .statistics import BLOCK, CHUNK, TILE, _as_numpy, _check_tunables, _kind, _pieces, _pool, _readonly

try:  # numpy >= 2
    from numpy.lib.array_utils import normalize_axis_index
except ImportError:  # pragma: no cover - numpy 1.26
    from numpy.core.multiarray import normalize_axis_index  # type: ignore[no-redef]

__all__ = ["quantize_int8", "dequantize_int8", "NonFiniteError", "NonFiniteWarning"]

_INPUTS = ("F32", "F16", "BF16")
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


class _Keys(NamedTuple):
    """Bit-pattern constants of an input format, typed like its unsigned view."""

    absmask: np.unsignedinteger  # clears the sign bit
    lim: np.unsignedinteger  # +Inf; larger magnitudes are NaN
    sign: np.unsignedinteger  # the sign bit
    it: np.dtype  # signed view
    ut: np.dtype  # unsigned view
    ft: np.dtype  # the float type itself


_KEYS = {
    "F32": _Keys(
        np.uint32(0x7FFFFFFF),
        np.uint32(0x7F800000),
        np.uint32(0x80000000),
        np.dtype(np.int32),
        np.dtype(np.uint32),
        np.dtype(np.float32),
    ),
    "F16": _Keys(
        np.uint16(0x7FFF),
        np.uint16(0x7C00),
        np.uint16(0x8000),
        np.dtype(np.int16),
        np.dtype(np.uint16),
        np.dtype(np.float16),
    ),
    "BF16": _Keys(
        np.uint16(0x7FFF),
        np.uint16(0x7F80),
        np.uint16(0x8000),
        np.dtype(np.int16),
        np.dtype(np.uint16),
        np.dtype(ml_dtypes.bfloat16),
    ),
}


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
    k = _KEYS[kind]
    outer, C, inner = _dims(piece.shape, sub_axis)
    oc, cc, ic = _grid(outer, C, inner, block, tasks)
    flat = _readonly(piece.reshape(-1))
    part, bad = _k.absmax_grid(
        flat.view(k.it), flat.view(k.ut), k.absmask, k.lim, k.sign, outer, C, inner, oc, cc, ic, parallel
    )
    # keys are |x| bit patterns: their max is the pattern of the largest magnitude
    amax = part.max(axis=0).view(k.ft).astype(np.float32)
    return amax, bad.sum(axis=0)


def _quantize_piece(piece, kind, sub_axis, scale, out, parallel, block, tile, tasks) -> None:
    outer, C, inner = _dims(piece.shape, sub_axis)
    oc, cc, ic = _grid(outer, C, inner, block, tasks)
    flat = _readonly(piece.reshape(-1))
    if kind == "F32":
        _k.quantize_grid(flat, scale, outer, C, inner, oc, cc, ic, out, parallel)
    else:
        fmt = _k.F16 if kind == "F16" else _k.BF16
        _k.quantize_grid_half(
            fmt, flat.view(np.uint16), scale, outer, C, inner, oc, cc, ic, tile, out, parallel
        )


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
    _check_tunables(block, tile, chunk)
    if on_nonfinite not in _ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {_ON_NONFINITE}, got {on_nonfinite!r}")
    a, is_torch = _as_numpy(x)
    kind = _kind(a.dtype, _INPUTS, "quantize_int8()")
    if axis is not None:
        axis = normalize_axis_index(axis, a.ndim)
    nchan = 1 if axis is None else a.shape[axis]

    with _pool(threads, a.size, block) as parallel:
        if _fusable(a, axis):
            # one read of x: both passes per row while it sits in L2
            q = np.empty(a.shape, np.int8)
            scale, bad = _fused(a, kind, axis, q, parallel, block, tile)
            _nonfinite(bad, on_nonfinite, name)
            return _result(q, scale, axis, is_torch)

        tasks = 4 * _pool_threads(threads) if parallel else 1
        amax = np.zeros(nchan, np.float32)
        bad = np.zeros(3, np.int64)
        for key, piece in _pieces(a, chunk, any_order=False):
            sub, sel = _channels(key, axis)
            pmax, pbad = _amax_piece(piece, kind, sub, parallel, block, tasks)
            amax[sel] = np.maximum(amax[sel], pmax if sub is not None else pmax[0])
            bad += pbad
        _nonfinite(bad, on_nonfinite, name)  # raises before the int8 output is allocated
        scale = amax / np.float32(127.0)
        scale[scale == 0] = np.float32(1.0)

        q = np.empty(a.shape, np.int8)
        for key, piece in _pieces(a, chunk, any_order=False):
            sub, sel = _channels(key, axis)
            s = scale[sel] if sub is not None else scale[sel : sel + 1] if axis is not None else scale
            # a view: q is C-contiguous and key a prefix index (the Ellipsis keeps a 0-d
            # result an array instead of a scalar copy)
            out = q[key + (Ellipsis,)].reshape(-1)
            _quantize_piece(piece, kind, sub, np.ascontiguousarray(s), out, parallel, block, tile, tasks)
    return _result(q, scale, axis, is_torch)


def _result(q, scale, axis, is_torch):
    scale = scale.reshape(()) if axis is None else scale
    if is_torch:
        import torch

        return torch.from_numpy(q), torch.from_numpy(scale)
    return q, scale


def _nonfinite(bad, on_nonfinite: str, name: str | None) -> None:
    """Raise NonFiniteError or warn, from the kernels' (NaN, +Inf, -Inf) counts."""
    bad = np.asarray(bad).reshape(-1, 3).sum(axis=0)
    if not bad.any():
        return
    nan, pos, neg = (int(v) for v in bad)
    msg = _nonfinite_message(name, nan, pos, neg)
    if on_nonfinite == "raise":
        raise NonFiniteError(
            msg
            + "; int8 quantization needs finite values (on_nonfinite='clamp' maps NaN to 0, +-Inf to +-127)",
            tensors=[name] if name else (),
            nan_count=nan,
            posinf_count=pos,
            neginf_count=neg,
        )
    warnings.warn(
        NonFiniteWarning(
            msg + "; quantized NaN to 0 and +-Inf to +-127",
            name=name,
            nan_count=nan,
            posinf_count=pos,
            neginf_count=neg,
        ),
        stacklevel=3,
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
    k = _KEYS[kind]
    _, C, inner = _dims(a.shape, axis)
    cc = max(1, block // inner)
    flat = _readonly(a.reshape(-1))
    ki, ku = flat.view(k.it), flat.view(k.ut)
    out = q.reshape(-1)
    if kind == "F32":
        return _k.quantize_rows_fused(flat, ki, ku, k.absmask, k.lim, k.sign, C, inner, cc, out, parallel)
    fmt = _k.F16 if kind == "F16" else _k.BF16
    return _k.quantize_rows_fused_half(
        fmt, ki, ku, k.absmask, k.lim, k.sign, C, inner, cc, tile, out, parallel
    )


def _pool_threads(threads: int | None) -> int:
    import numba

    return numba.get_num_threads() if threads is None else threads


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
    qa, is_torch = _as_numpy(q)
    sa, _ = _as_numpy(scale)
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
