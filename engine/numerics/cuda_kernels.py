"""Numba CUDA kernels: NaN/Inf statistics and symmetric int8 quantization in device memory.

The device counterparts of :mod:`engine.numerics.kernels`, with the same arithmetic and the same
constants (the layout table :data:`engine.numerics._arrays.FLOAT_FORMATS` and the ``sc``/``uc``
arrays of :func:`engine.numerics._arrays.float_consts`), so that one oracle suite
(``tests/naive.py``) checks both targets.  All device kernels live in this one module:
Numba's cache is keyed on the file that defines a function.  Importing it imports
``numba.cuda``; with ``NUMBA_ENABLE_CUDASIM=1`` set before Numba is first imported the
kernels run on the CPU under Numba's CUDA simulator, which is how the test suite runs them
without a GPU.  The host side (launch sizes, streams, merging) is :mod:`engine.numerics.device`.

Conventions
-----------
* Every kernel reads the tensor's bytes through integer views (``ki`` signed, ``ku``
  unsigned, of the element's width) and, for float32/float64 data, the float view ``f``;
  F16/BF16 values are decoded from their bit patterns exactly (:func:`_decode`), never
  through a float16 type the simulator and every GPU would treat alike only by luck.
* No bit casts: Numba's CUDA target has none in Python syntax.  A float is rebuilt from its
  pattern as ``mantissa * 2**k`` with ``2**k`` from a table of exact powers of two, which
  is exact for every finite F16, BF16 and F32 value, subnormals included.  Float32 results
  that must come out bit for bit (quantization scales) are then stored through a ``uint32``
  array that the host views as ``float32``.
* No fast-math: ``x / scale`` is an IEEE division (``div.rn.f32``) and ``round`` rounds half
  to even (``llrint``), as ``numpy.rint`` does, so quantization is bit-identical to
  :func:`engine.quantize_int8`.
* Moments are summed per thread around the first finite value it sees (float64), then
  merged over the block in shared memory and into the caller's accumulator rows with Chan's
  pairwise update, exactly as the CPU kernels merge blocks.
* ``MAX_THREADS`` sizes the shared reduction arrays (a compile-time constant); a launch
  uses any power of two up to it.
"""

from __future__ import annotations

import importlib.util

import numpy as np
from numba import config, cuda, float32, float64, int64, uint64

from engine.numerics._arrays import BF16, F16
from engine.numerics.kernels import chan, fold_one, moments


def _load_array_support() -> None:
    """Import numba-cuda's array support while ``numpy.row_stack`` exists.

    numba-cuda (0.30.4 and earlier) runs ``overload(np.row_stack)`` when
    ``numba.cuda.np.arrayobj`` loads, which happens at the first compile; numpy 2.5 removed
    ``row_stack``, so there every kernel compile fails with an AttributeError.  Where numpy
    lacks it, a stand-in of our own (a function nothing else can reach: the overload binds to
    it, never to ``np.vstack``) is put on numpy for that import only and taken off again,
    so user code never sees it.  Nothing is done where numpy still has ``row_stack``, under
    the simulator (it compiles nothing), with Numba's built-in CUDA target (it has no such
    module; Numba >= 0.68 guards its own reference) or once the module is loaded.  Remove
    when numba-cuda guards the reference itself.
    """
    name = "numba.cuda.np.arrayobj"
    if "row_stack" in vars(np) or config.ENABLE_CUDASIM:
        return
    try:
        if importlib.util.find_spec(name) is None:
            return
    except ImportError:  # numba.cuda.np itself missing: Numba's built-in CUDA target
        return
    import sys

    if name in sys.modules:
        return

    def row_stack(tup):  # never called: the overload's key while the module loads
        return np.vstack(tup)

    namespace = vars(np)  # numpy's module dict: the attribute, whatever numpy's stubs say of it
    namespace["row_stack"] = row_stack
    try:
        import numba.cuda.np.arrayobj  # noqa: F401  (the module that refers to np.row_stack)
    finally:
        del namespace["row_stack"]


_load_array_support()

#: sha256 of the source of ``kernels.fold_one``, ``kernels.moments`` and ``kernels.chan``:
#: this file's cached device kernels have them compiled in, and Numba's cache checks only
#: this file, so an edit there must change this line too (``tests/test_kernels.py`` fails
#: until it does)
SHARED_SHA256 = "5b5ce76ee2223420b58f51fb3ebddfa51eae3694a9478b743ca8a6d42d366b51"

__all__ = [
    "MAX_THREADS",
    "fill_zero",
    "init_stats",
    "stats_fold",
    "absmax_runs",
    "absmax_columns",
    "scales_from_keys",
    "quantize_elements",
]

#: Threads per block at most: the shared reduction arrays hold one row per thread.
MAX_THREADS = 256

#: 2**k for k in [-149, 127], every one exact in float32 (2**-149 is the smallest subnormal).
_POW2 = np.ldexp(np.float32(1.0), np.arange(-149, 128)).astype(np.float32)
_POW2_BIAS = 149


@cuda.jit(device=True, cache=True)
def _decode(bits, mbits, bias):
    """float32 value of the non-negative finite pattern ``bits`` of a format with ``mbits``
    mantissa bits and exponent ``bias``: ``mantissa * 2**(e - bias - mbits)``, exact."""
    b = int64(bits)
    e = b >> mbits
    m = b & ((1 << mbits) - 1)
    if e == 0:
        e = 1  # subnormal: no implicit bit, exponent of the smallest normal
    else:
        m = m | (1 << mbits)
    return float32(m) * _POW2[e - bias - mbits + _POW2_BIAS]


@cuda.jit(device=True, cache=True)
def _half_value(fmt, u):
    """float32 value of the finite F16 (``fmt == F16``) or BF16 pattern ``u``."""
    b = int64(u)
    if fmt == F16:
        v = _decode(b & 0x7FFF, 10, 15)
    else:
        v = _decode(b & 0x7FFF, 7, 127)
    return -v if b & 0x8000 else v


@cuda.jit(device=True, cache=True)
def _value(fmt, f, u, i):
    """float64 value of element ``i``: from the float view ``f``, or decoded from the
    F16/BF16 pattern ``u`` (0.0 for the NaN and infinity patterns, which the fold only counts)."""
    if fmt == F16 or fmt == BF16:
        if (int64(u) & 0x7FFF) >= (0x7C00 if fmt == F16 else 0x7F80):
            return 0.0  # NaN or an infinity: counted by the fold, its value never used
        return float64(_half_value(fmt, u))
    return float64(f[i])


_fold_one = cuda.jit(device=True, cache=True)(fold_one)
_moments = cuda.jit(device=True, cache=True)(moments)


_chan = cuda.jit(device=True, cache=True)(chan)


@cuda.jit(cache=True)
def fill_zero(a):
    """``a[:] = 0`` (a 1-D array of any number type)."""
    i = cuda.grid(1)
    if i < a.size:
        a[i] = 0


@cuda.jit(cache=True)
def init_stats(sc, uc, cnt, mom, skey, ukey):
    """Reset accumulator rows: zero counts and moments, identities of the key reductions."""
    r = cuda.grid(1)
    if r < cnt.shape[0]:
        for j in range(5):
            cnt[r, j] = 0
        mom[r, 0] = 0.0
        mom[r, 1] = 0.0
        skey[r, 0] = int64(sc[1])
        skey[r, 1] = int64(sc[2])
        ukey[r] = uint64(uc[3])


@cuda.jit(cache=True)
def stats_fold(fmt, f, ki, ku, sc, uc, cnt, mom, skey, ukey):
    """Fold the elements of ``ku`` into accumulator rows, one row per block.

    ``f`` is the float view (float32/float64 data) or ``ku`` again (F16/BF16, ``fmt``);
    ``ki``/``ku`` the signed and unsigned integer views of the same memory; ``sc``/``uc``
    the constants of :func:`engine.numerics._arrays.float_consts` as tuples, passed by value
    (``(LIM, SMIN, SMAX)`` and ``(ABSMASK, LIM, NEGLIM, 0)``).  Block ``b`` merges its part into ``cnt[b]`` [finite,
    nan, +inf, -inf, zero], ``mom[b]`` [mean, M2], ``skey[b]`` [max_i, min_i] (int64) and
    ``ukey[b]`` [max_u] (uint64): the partial-row layout of :func:`engine.numerics.kernels.stats_values`,
    merged on the host by the same code.  Launches that share rows must be ordered (one
    stream); the grid must not exceed the rows.
    """
    s_cnt = cuda.shared.array((MAX_THREADS, 5), int64)
    s_mom = cuda.shared.array((MAX_THREADS, 2), float64)
    s_key = cuda.shared.array((MAX_THREADS, 2), int64)
    s_ukey = cuda.shared.array(MAX_THREADS, uint64)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    b = cuda.blockIdx.x
    step = cuda.gridDim.x * nt
    n = ku.size
    absmask = uint64(uc[0])
    lim = uint64(uc[1])
    nfin = 0
    nnan = 0
    npos = 0
    nneg = 0
    nz = 0
    max_i = int64(sc[1])
    min_i = int64(sc[2])
    max_u = uint64(uc[3])
    shift = 0.0
    sd = 0.0
    sd2 = 0.0
    i = b * nt + tid
    while i < n:
        u = ku[i]
        nfin, nnan, npos, nneg, nz, max_i, min_i, max_u, shift, sd, sd2 = _fold_one(
            uint64(u), int64(ki[i]), _value(fmt, f, u, i), absmask, lim,
            nfin, nnan, npos, nneg, nz, max_i, min_i, max_u, shift, sd, sd2)
        i += step
    mean, m2 = _moments(nfin, shift, sd, sd2, 0.0)
    s_cnt[tid, 0] = nfin
    s_cnt[tid, 1] = nnan
    s_cnt[tid, 2] = npos
    s_cnt[tid, 3] = nneg
    s_cnt[tid, 4] = nz
    s_mom[tid, 0] = mean
    s_mom[tid, 1] = m2
    s_key[tid, 0] = max_i
    s_key[tid, 1] = min_i
    s_ukey[tid] = max_u
    cuda.syncthreads()
    half = nt // 2
    while half > 0:
        if tid < half:
            o = tid + half
            n_, mean_, m2_ = _chan(s_cnt[tid, 0], s_mom[tid, 0], s_mom[tid, 1], s_cnt[o, 0], s_mom[o, 0], s_mom[o, 1])
            s_mom[tid, 0] = mean_
            s_mom[tid, 1] = m2_
            for j in range(5):
                s_cnt[tid, j] += s_cnt[o, j]
            if s_key[o, 0] > s_key[tid, 0]:
                s_key[tid, 0] = s_key[o, 0]
            if s_key[o, 1] < s_key[tid, 1]:
                s_key[tid, 1] = s_key[o, 1]
            if s_ukey[o] > s_ukey[tid]:
                s_ukey[tid] = s_ukey[o]
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        n_, mean_, m2_ = _chan(cnt[b, 0], mom[b, 0], mom[b, 1], s_cnt[0, 0], s_mom[0, 0], s_mom[0, 1])
        mom[b, 0] = mean_
        mom[b, 1] = m2_
        for j in range(5):
            cnt[b, j] += s_cnt[0, j]
        if s_key[0, 0] > skey[b, 0]:
            skey[b, 0] = s_key[0, 0]
        if s_key[0, 1] < skey[b, 1]:
            skey[b, 1] = s_key[0, 1]
        if s_ukey[0] > ukey[b]:
            ukey[b] = s_ukey[0]


# --------------------------------------------------------------------------- quantization
#
# As on the CPU, a tensor is seen as (outer, C, inner): channel c is the ``outer`` runs
# x[o, c, :] of ``inner`` contiguous elements (C == 1 per tensor).  The per-channel maximum
# magnitude is reduced on the unsigned bit patterns (``pattern & absmask`` orders like the
# magnitude), into ``keys[C]`` (uint32, zeroed by the caller) with atomic max.


@cuda.jit(device=True, cache=True)
def _classify_max(u, absmask, lim, bad):
    """Magnitude key of a finite ``u`` (0 for NaN/Inf, which are counted into ``bad``)."""
    a = u & absmask
    if a < lim:
        return uint64(a)
    if a > lim:
        cuda.atomic.add(bad, 0, 1)
    elif u == a:
        cuda.atomic.add(bad, 1, 1)
    else:
        cuda.atomic.add(bad, 2, 1)
    return uint64(0)


@cuda.jit(cache=True)
def absmax_runs(ku, absmask, lim, C, inner, per_run, keys, bad):
    """Channel maxima when runs are long (``inner`` large, or one run per tensor).

    ``per_run`` blocks share each run x[o, c, :] (block ``r * per_run + p``, threads
    striding the run); the block's maximum goes into ``keys[c]`` with one atomic max.
    NaN/Inf are counted into ``bad`` [nan, +inf, -inf] (int64).
    """
    s_max = cuda.shared.array(MAX_THREADS, uint64)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    run = cuda.blockIdx.x // per_run
    p = cuda.blockIdx.x - run * per_run
    base = run * inner
    c = run % C
    m = uint64(0)
    i = p * nt + tid
    while i < inner:
        a = _classify_max(ku[base + i], absmask, lim, bad)
        m = a if a > m else m
        i += per_run * nt
    s_max[tid] = m
    cuda.syncthreads()
    half = nt // 2
    while half > 0:
        if tid < half and s_max[tid + half] > s_max[tid]:
            s_max[tid] = s_max[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid == 0 and s_max[0] > 0:
        cuda.atomic.max(keys, c, np.uint32(s_max[0]))


@cuda.jit(cache=True)
def absmax_columns(ku, absmask, lim, outer, C, inner, rows_per_block, keys, bad):
    """Channel maxima when runs are short (``inner`` small, e.g. a scale per column).

    2-D grid: thread x of block (bx, by) takes element index ``j = bx * blockDim + x`` of
    the ``C * inner`` elements of a row of the outer axis (neighbouring threads read
    neighbouring bytes) for ``rows_per_block`` consecutive outer indices from
    ``by * rows_per_block``, then one atomic max per thread.
    """
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    width = C * inner
    if j >= width:
        return
    o0 = cuda.blockIdx.y * rows_per_block
    o1 = o0 + rows_per_block
    if o1 > outer:
        o1 = outer
    m = uint64(0)
    for o in range(o0, o1):
        a = _classify_max(ku[o * width + j], absmask, lim, bad)
        m = a if a > m else m
    if m > 0:
        cuda.atomic.max(keys, j // inner, np.uint32(m))


@cuda.jit(cache=True)
def scales_from_keys(keys, mbits, bias, scale):
    """``scale = float32(amax) / float32(127)``, 1 where that is 0, from the maximum
    magnitude patterns ``keys`` of a format with ``mbits`` mantissa bits and ``bias``."""
    c = cuda.grid(1)
    if c >= keys.size:
        return
    s = _decode(keys[c], mbits, bias) / float32(127.0)
    scale[c] = s if s != 0 else float32(1.0)


@cuda.jit(cache=True)
def quantize_elements(fmt, f, ku, absmask, lim, C, inner, scale, q):
    """``q = clip(rint(float32(x) / scale[c]), -127, 127)`` with NaN -> 0 and +-Inf ->
    +-127, element by element (grid-stride), ``c = (i // inner) % C``.

    ``f`` is the float32 view, or ``ku`` again for F16/BF16 (``fmt``); NaN and Inf are
    told apart on the bit patterns ``ku`` (``absmask``, ``lim`` as for the statistics).
    """
    i = cuda.grid(1)
    step = cuda.gridsize(1)
    n = ku.size
    while i < n:
        u = ku[i]
        a = u & absmask
        if a > lim:
            v = 0
        elif a == lim:
            v = 127 if u == a else -127
        else:
            if fmt == F16 or fmt == BF16:
                x = _half_value(fmt, u)
            else:
                x = float32(f[i])
            r = x / scale[(i // inner) % C]  # IEEE division, as numpy's
            if r >= float32(127.0):
                v = 127
            elif r <= float32(-127.0):
                v = -127
            else:
                v = round(r)  # half to even (llrint), as numpy.rint
        q[i] = v
        i += step
