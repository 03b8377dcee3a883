"""Statistics and int8 quantization with the array framework's own operations, where the data is.

The fallback of device loads where Numba's CUDA target cannot run (numba-cuda missing, no
NVVM, a driver it does not know: :func:`engine.loading.kernel_probe.device_kernels_unusable`): the
same results as :func:`engine.stats` and :func:`engine.quantize_int8` (counts, min, max,
absmax, every int8 value and scale exactly; mean and std within rounding of the float64
sums, taken in another order), computed by torch operations on the tensor's own device, or
CuPy's on a CuPy array.  Nothing here copies tensor bytes to the host: each tensor's
statistics come back as one small array of partial results, merged by the CPU kernels'
own code (:func:`engine.numerics.statistics.stats_from_partials`).

The operations are device-agnostic: the test suite runs them on CPU torch tensors, and on
numpy arrays standing for CuPy's (CuPy follows numpy's API).

How the results come out exact
------------------------------
* Every test is made on the integer bit patterns, as the kernels make them: NaN and the
  infinities by ``pattern & absmask`` against the +Inf pattern, zeros (``-0.0`` too) by
  ``pattern & absmask == 0``; min and max are reduced on the signed patterns and decoded
  by the kernels' rule, so signed zeros come out as the CPU's.
* A channel's largest magnitude is the largest ``pattern & absmask`` (that orders as the
  magnitude does), decoded exactly to float32.
* ``scale = amax / 127`` and ``x / scale`` divide by a tensor on the data's device: torch
  turns a division by a host scalar into a multiplication by its reciprocal on CUDA, which
  is not IEEE division.  Rounding is half to even (``torch.round``, ``rint``), as ``numpy.rint``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import numpy as np

from engine.numerics._arrays import FLOAT_FORMATS
from engine.numerics.statistics import Stats, stats_from_partials

__all__ = ["CHUNK", "SUPPORTED_NAMES", "ArrayOps", "TorchOps", "ops_for", "quantize", "stats_parts", "stats_result"]

#: Format dtypes whose statistics the fallback computes (those of the device kernels).
SUPPORTED_NAMES = frozenset(("F64", "F32", "F16", "BF16"))

#: Elements per pass: bounds the temporaries one pass makes (float64 values: 128 MiB).
CHUNK = 1 << 24

#: Columns of one pass's partial result (int64): counts [finite, nan, +inf, -inf, zero],
#: keys [max_i, min_i], [finite negatives, their largest signed pattern], then mean and M2
#: (float64 bits).
_NFIELDS = 11


class TorchOps:
    """The operations the fallback needs, as torch does them (on the tensors' device)."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        self.t = torch
        self._dtypes = {np.dtype(n): getattr(torch, n) for n in ("int8", "int16", "int32", "int64", "uint8",
                                                                  "float16", "float32", "float64")}
        self._floats = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}

    def on(self, x):  # torch runs each operation on its operands' device
        return nullcontext()

    def bytes_of(self, x):
        return x.reshape(-1).view(self.t.uint8)

    def view(self, x, dtype):
        return x.view(self._dtypes[np.dtype(dtype)])

    def values(self, bits, kind: str, dtype):
        """The values of the patterns ``bits`` of format ``kind`` as float32 or float64, exactly."""
        return bits.view(self._floats[kind]).to(self._dtypes[np.dtype(dtype)])

    def astype(self, x, dtype):
        return x.to(self._dtypes[np.dtype(dtype)])

    def where(self, cond, a, b):
        return self.t.where(cond, a, b)

    def amax(self, x, axes=None):
        return self.t.amax(x) if axes is None else self.t.amax(x, dim=axes)

    def amin(self, x):
        return self.t.amin(x)

    def maximum(self, a, b):
        return self.t.maximum(a, b)

    def isfinite(self, x):
        return self.t.isfinite(x)

    def rint(self, x):
        return self.t.round(x)  # half to even

    def clip(self, x, lo, hi):
        return self.t.clamp(x, lo, hi)

    def full(self, like, shape, value, dtype):
        return self.t.full(shape, value, dtype=self._dtypes[np.dtype(dtype)], device=like.device)

    def stack(self, xs):
        return self.t.stack(xs)

    def assign(self, dst, src) -> None:
        dst.copy_(src)

    def release(self, x) -> None:
        """``x`` is about to be dropped with work still queued on it: the caching allocator
        must not hand its memory out before that work is done (another stream may ask)."""
        if x.device.type == "cuda":
            x.record_stream(self.t.cuda.current_stream(x.device))

    def host(self, x) -> np.ndarray:
        """A small result array on the host (the one device-to-host copy of a tensor's work)."""
        return np.array(x.tolist(), np.int64)


class ArrayOps:
    """The same operations in a numpy-like module: CuPy (on the current CuPy device), or
    numpy standing for it in the tests."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self.name = xp.__name__

    def on(self, x):
        device = getattr(x, "device", None)  # a cupy array's device: run where it lives
        return device if hasattr(device, "__enter__") else nullcontext()

    def bytes_of(self, x):
        return x.reshape(-1).view(np.uint8)

    def view(self, x, dtype):
        return x.view(np.dtype(dtype))

    def values(self, bits, kind: str, dtype):
        with np.errstate(invalid="ignore"):  # numpy's warning for NaN payloads; CuPy has none
            if kind == "BF16":  # no bfloat16 in CuPy: the pattern is the top half of a float32's
                u = bits.view(np.uint16).astype(np.uint32) << 16
                return u.view(np.float32).astype(dtype, copy=False)
            return bits.view(np.dtype(FLOAT_FORMATS[kind][3])).astype(dtype)

    def astype(self, x, dtype):
        return x.astype(dtype)

    def where(self, cond, a, b):
        return self.xp.where(cond, a, b)

    def amax(self, x, axes=None):
        return self.xp.amax(x, axis=axes)

    def amin(self, x):
        return self.xp.amin(x)

    def maximum(self, a, b):
        return self.xp.maximum(a, b)

    def isfinite(self, x):
        return self.xp.isfinite(x)

    def rint(self, x):
        return self.xp.rint(x)

    def clip(self, x, lo, hi):
        return self.xp.clip(x, lo, hi)

    def full(self, like, shape, value, dtype):
        return self.xp.full(shape, value, dtype=dtype)

    def stack(self, xs):
        return self.xp.stack([self.xp.asarray(x) for x in xs])

    def assign(self, dst, src) -> None:
        dst[...] = src

    def release(self, x) -> None:
        """As :meth:`TorchOps.release`; CuPy's pool has no per-array stream record, so the
        queued work is waited for (once per quantized tensor)."""
        stream = getattr(getattr(self.xp, "cuda", None), "get_current_stream", None)
        if stream is not None:
            with self.on(x):
                stream().synchronize()

    def host(self, x) -> np.ndarray:
        get = getattr(x, "get", None)  # cupy: one copy of the small result
        return np.asarray(get() if callable(get) and not isinstance(x, np.ndarray) else x, np.int64)


def ops_for(framework: str) -> TorchOps | ArrayOps | None:
    """The operations of a sink's framework (``"torch"``, ``"cupy"``), or None for another."""
    if framework == "torch":
        return TorchOps()
    if framework == "cupy":
        import cupy

        return ArrayOps(cupy)
    return None


class _Format:
    """Bit-pattern constants of a float format, as Python ints for the signed view."""

    def __init__(self, kind: str) -> None:
        it, _, lim, _ = FLOAT_FORMATS[kind]
        self.it = np.dtype(it)
        self.nbits = 8 * self.it.itemsize
        sign = 1 << (self.nbits - 1)
        self.absmask = sign - 1
        self.lim = lim  # +Inf's pattern
        self.neglim = lim - sign  # -Inf's pattern, read as signed
        self.smin, self.smax = -sign, sign - 1


# --------------------------------------------------------------------------- statistics


def stats_parts(ops, buf, kind: str, chunk: int = CHUNK) -> list:
    """Partial statistics of the float data ``buf`` (a C-contiguous device array of format
    ``kind``, of any view dtype, or its bytes): one small device array per pass of ``chunk``
    elements, queued on the device without waiting for it.  :func:`stats_result` merges them."""
    k = _Format(kind)
    with ops.on(buf):
        raw = ops.bytes_of(buf)
        if not raw.shape[0]:
            return []
        bits = ops.view(raw, k.it)
        n = int(bits.shape[0])
        return [_stats_pass(ops, bits[lo : lo + chunk], kind, k) for lo in range(0, n, chunk)]


def _stats_pass(ops, bits, kind: str, k: _Format):
    a = bits & k.absmask
    finite = a < k.lim
    nfin = finite.sum()
    negf = finite & (bits < 0)
    v = ops.where(finite, ops.values(bits, kind, np.float64), 0.0)
    fin = ops.maximum(ops.astype(nfin, np.float64), ops.full(v, (), 1.0, np.float64))  # 0/0 is never asked
    mean = v.sum() / fin
    if kind == "F64":  # a sum of float64 data near the overflow threshold can overflow: sum the quotients
        mean = ops.where(ops.isfinite(mean), mean, (v / fin).sum())
    d = ops.where(finite, v - mean, 0.0)
    m2 = (d * d).sum()
    fields = [
        nfin, (a > k.lim).sum(), (bits == k.lim).sum(), (bits == k.neglim).sum(), (a == 0).sum(),
        ops.amax(ops.where(finite, bits, k.smin)), ops.amin(ops.where(finite, bits, k.smax)),
        negf.sum(), ops.amax(ops.where(negf, bits, k.smin)),
    ]
    ints = [ops.astype(f, np.int64) for f in fields]
    return ops.stack([*ints, ops.view(ops.astype(mean, np.float64), np.int64),
                      ops.view(ops.astype(m2, np.float64), np.int64)])


def stats_result(ops, kind: str, parts: list) -> Stats:
    """:class:`Stats` from :func:`stats_parts`'s arrays (waits for them: one small copy)."""
    if not parts:
        return Stats.empty()
    rows = ops.host(ops.stack(parts)).reshape(-1, _NFIELDS)
    k = _Format(kind)
    cnt = np.ascontiguousarray(rows[:, :5])
    skey = np.ascontiguousarray(rows[:, 5:7])
    mom = np.ascontiguousarray(rows[:, 9:11]).view(np.float64)
    # the unsigned key: the largest negative pattern where there is one (it orders above
    # every non-negative one), else the largest non-negative, which is max_i
    mask = np.uint64((1 << k.nbits) - 1)  # a signed pattern of the format's width, read unsigned
    ukey = np.where(rows[:, 7] > 0, rows[:, 8].astype(np.uint64) & mask,
                    np.where(rows[:, 0] > 0, rows[:, 5], 0).astype(np.uint64))
    return stats_from_partials(kind, cnt, mom, skey, ukey)


# --------------------------------------------------------------------------- quantization


def _blocks(outer: int, C: int, inner: int, chunk: int) -> Iterator[tuple[slice, slice, slice]]:
    """Slices of the (outer, C, inner) view covering it in passes of about ``chunk`` elements."""
    if inner >= chunk:
        for o in range(outer):
            for c in range(C):
                for i in range(0, inner, chunk):
                    yield slice(o, o + 1), slice(c, c + 1), slice(i, i + chunk)
    elif C * inner >= chunk:
        step = max(1, chunk // inner)
        for o in range(outer):
            for c in range(0, C, step):
                yield slice(o, o + 1), slice(c, c + step), slice(None)
    else:
        step = max(1, chunk // (C * inner))
        for o in range(0, outer, step):
            yield slice(o, o + step), slice(None), slice(None)


def quantize(ops, src, kind: str, shape: tuple, axis: int | None, q, scale, chunk: int = CHUNK):
    """Quantize ``src`` (C-contiguous device array of format ``kind``, any view dtype, or
    its bytes; None when it has no elements) of ``shape`` along ``axis`` (None: per tensor,
    else normalized) into ``q`` (int8, C-contiguous, ``prod(shape)`` elements) and ``scale``
    (float32, ``C`` elements), as :func:`engine.quantize_int8` does.

    Returns the (NaN, +Inf, -Inf) counts as a device int64 array of 3, not yet waited for:
    ``ops.host(bad)`` brings them over.
    """
    k = _Format(kind)
    n = math.prod(shape)
    outer, C, inner = (1, 1, n) if axis is None else (
        math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :]))
    with ops.on(q):
        sc = scale.reshape(-1)
        if n == 0:  # no values: every channel's amax is 0, so its scale 1
            if C:
                ops.assign(sc, ops.full(sc, (C,), 1.0, np.float32))
            return ops.full(sc, (3,), 0, np.int64)
        bits = ops.view(ops.bytes_of(src), k.it).reshape(outer, C, inner)
        q3 = q.reshape(outer, C, inner)
        keys = ops.full(sc, (C,), 0, k.it)
        bad = []
        for s in _blocks(outer, C, inner, chunk):
            b = bits[s]
            a = b & k.absmask
            m = ops.amax(ops.where(a < k.lim, a, 0), (0, 2))
            ops.assign(keys[s[1]], ops.maximum(keys[s[1]], m))
            bad.append(ops.stack([ops.astype(x.sum(), np.int64) for x in (a > k.lim, b == k.lim, b == k.neglim)]))
        amax = ops.values(keys, kind, np.float32)
        s127 = ops.full(amax, (C,), 127.0, np.float32)  # a device array: a true division (module docstring)
        s = amax / s127
        ops.assign(sc, ops.where(s == 0, ops.full(s, (C,), 1.0, np.float32), s))
        for sl in _blocks(outer, C, inner, chunk):
            b = bits[sl]
            a = b & k.absmask
            r = ops.values(b, kind, np.float32) / sc[sl[1]].reshape(1, -1, 1)
            r = ops.rint(ops.clip(r, -127.0, 127.0))  # rint(clip(r)) == clip(rint(r)): 127 is whole
            nonfinite = ops.where(a > k.lim, 0.0, ops.where(b < 0, -127.0, 127.0))
            ops.assign(q3[sl], ops.astype(ops.where(a < k.lim, r, nonfinite), np.int8))
        return ops.stack(bad).sum(0) if len(bad) > 1 else bad[0]
