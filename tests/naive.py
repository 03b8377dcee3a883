"""Plain NumPy oracles for every Numba kernel (the stumpy ``tests/naive.py`` habit).

Written for clarity, not speed: each one states the definition the kernels must meet, with
numpy and ml_dtypes doing the conversions.  Never import engine.numerics.kernels here.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
HALF_DTYPES = {"F16": np.dtype(np.float16), "BF16": BF16}


def widen_half(bits: np.ndarray, kind: str) -> np.ndarray:
    """float32 values of uint16 F16/BF16 bit patterns, converted by numpy/ml_dtypes."""
    return bits.view(HALF_DTYPES[kind]).astype(np.float32)


def stats(x) -> dict:
    """Field -> value of engine.Stats for array ``x``, from float64 (or exact int) numpy.

    min/max/absmax/mean/std over the finite values; NaN and +-Inf counted; -0.0 is a zero;
    population std; NaN where no finite value exists; ints stay Python ints.
    """
    x = np.asarray(x)
    flat = x.reshape(-1)
    if flat.dtype == np.bool_:
        flat = flat.astype(np.uint8)
    integer = flat.dtype.kind in "iu"
    if integer:
        fin = flat
        nan = pos = neg = 0
    else:
        f64 = flat.astype(np.float64)
        nan = int(np.isnan(f64).sum())
        pos = int(np.isposinf(f64).sum())
        neg = int(np.isneginf(f64).sum())
        fin = f64[np.isfinite(f64)]
    zero = int((flat == 0).sum())
    if fin.size == 0:
        mn = mx = absmax = mean = std = math.nan
    else:
        if integer:
            mn, mx = int(fin.min()), int(fin.max())
        else:
            mn, mx = float(fin.min()), float(fin.max())
        absmax = max(abs(mn), abs(mx))
        f = fin.astype(np.float64)
        mean = float(np.mean(f))
        std = float(np.std(f))  # ddof=0
    return dict(
        count=int(flat.size),
        min=mn,
        max=mx,
        mean=mean,
        std=std,
        absmax=absmax,
        nan_count=nan,
        posinf_count=pos,
        neginf_count=neg,
        zero_count=zero,
    )


def _channel_view(x: np.ndarray, axis):
    """Axes to reduce over and the shape a per-channel vector broadcasts with."""
    if axis is None:
        return None, ()
    axis = axis % x.ndim
    return tuple(d for d in range(x.ndim) if d != axis), [-1 if d == axis else 1 for d in range(x.ndim)]


def absmax(x: np.ndarray, axis=None) -> np.ndarray:
    """float32 max |float32(x)| over the finite values, per tensor (shape ()) or channel."""
    xf = np.asarray(x).astype(np.float32)
    red, _ = _channel_view(xf, axis)
    mag = np.where(np.isfinite(xf), np.abs(xf), np.float32(0))
    return np.max(mag, axis=red, initial=np.float32(0)).astype(np.float32)


def quantize_int8(x: np.ndarray, axis=None):
    """The issue's formula, step by step in float32.

    scale = float32(amax) / float32(127), 1 where that is 0;
    q = clip(rint(float32(x) / scale), -127, 127) with NaN -> 0 (so +-Inf -> +-127).
    """
    xf = np.asarray(x).astype(np.float32)
    scale = scale_of(absmax(xf, axis))
    return quantize_with_scale(xf, scale, axis), scale


def scale_of(amax: np.ndarray) -> np.ndarray:
    """float32(amax) / float32(127), with 1 where that is 0."""
    scale = np.asarray(amax, np.float32) / np.float32(127)
    return np.where(scale == 0, np.float32(1), scale).astype(np.float32)


def quantize_with_scale(x: np.ndarray, scale: np.ndarray, axis=None) -> np.ndarray:
    """clip(rint(float32(x) / scale), -127, 127) as int8, NaN -> 0; ``scale`` per tensor
    (one value) or per channel along ``axis``.  Usable on row slabs of a big tensor."""
    xf = np.asarray(x).astype(np.float32)
    _, bshape = _channel_view(xf, axis)
    sb = np.asarray(scale, np.float32).reshape(bshape)
    with np.errstate(invalid="ignore"):
        r = np.rint(xf / sb)  # true float32 division, half-to-even rounding
    r = np.where(np.isnan(r), np.float32(0), r)
    return np.clip(r, -127, 127).astype(np.int8)


def dequantize_int8(q: np.ndarray, scale: np.ndarray, axis=None, dtype=np.float32) -> np.ndarray:
    _, bshape = _channel_view(q, axis)
    return (q.astype(np.float32) * np.asarray(scale, np.float32).reshape(bshape)).astype(dtype)
