"""Numba kernels: fused statistics and symmetric int8 quantization.

Every kernel lives in this one module because Numba's on-disk cache (``cache=True``) is keyed
on the file that defines a function and does not notice edits to helpers in other files.

Conventions shared by all kernels
---------------------------------
* Inputs are flat, C-contiguous 1-D arrays (a whole tensor or one chunk of it while a file
  streams in); the callers in :mod:`engine.numerics.statistics` and :mod:`engine.numerics.quantize` pass read-only
  views, so a kernel that wrote to its input would fail to compile, and each dtype compiles
  once instead of once per writeability.
* F16 and BF16 arrive as ``uint16`` views.  Anything that only needs ordering (min, max,
  absmax, zero and NaN/Inf tests) runs on the integer bit patterns, which also vectorizes
  without any fast-math flag (LLVM will not vectorize a float min/max reduction unless it
  may assume no NaN).  Values needed as floats are widened a *tile* (a few thousand
  elements, L1-resident) at a time into a per-task float32 scratch buffer: never a copy of
  the tensor.
* Work is split into blocks of ``block`` elements; each block writes its own partial
  result row and the rows are merged serially at the end (Chan et al.'s pairwise update
  for mean and M2), so ``prange`` needs no atomics and a caller can merge results of
  chunks the same way.  ``block`` and ``tile`` are arguments, not module globals.
* The ``*_block`` kernels fold data into accumulators that the caller owns, so one tensor
  can be fed in any number of calls (``engine.numerics.statistics.Accumulator``); the ``read_fold``/``read_fold_int``
  kernels read a piece of a file themselves, window by window, and fold each window while
  it is still in L2.
* ``parallel=False`` runs the same code on the calling thread only.  Callers that already
  run one kernel per worker thread want that: the kernels are ``nogil``.
* The only fast-math flags are ``reassoc`` and ``contract`` on the moment sums, which run on
  finite values only; they let LLVM vectorize the float64 accumulation and never change how
  NaN or Inf are handled.  Quantization uses no fast-math flag at all: ``x / scale`` stays a
  true IEEE division (``arcp`` would turn it into a multiplication by the reciprocal and
  break bit-identity with NumPy).
* Loops index slices from 0 (``t = x[lo:hi]; t[i]``): with ``x[lo + i]`` Numba cannot prove
  the index non-negative and emits wraparound code that stops vectorization.
* Integer arithmetic on bit patterns is written for ``int64`` so that Numba and plain Python
  (``NUMBA_DISABLE_JIT=1``, which the test suite also runs under) compute the same values;
  every constant compared with a ``uint64`` is passed in with that type, because Numba
  compares ``uint64`` with ``int64`` in float64.
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from engine.numerics._arrays import BF16, F16, FLOAT  # ``fmt`` codes, shared with the device kernels

__all__ = [
    "F16",
    "BF16",
    "widen_half",
    "stats_values",
    "stats_int",
    "init_keys",
    "merge_float_blocks",
    "Acc",
    "fold_block",
    "int_block",
    "read_fold",
    "read_fold_int",
    "Grid",
    "Keys",
    "absmax_grid",
    "quantize_grid",
    "quantize_rows_fused",
]


# error_model="numpy": a float division is a plain IEEE division.  Numba's default
# ("python") tests every divisor for zero to raise ZeroDivisionError, and that branch keeps
# LLVM from vectorizing ``f[j] / scale[j]``.  No kernel divides by zero (scales are >= the
# smallest subnormal, counts are >= 1).
_OPTS = dict(cache=True, nogil=True, error_model="numpy")
_MOMENT_MATH = {"reassoc", "contract"}  # never nnan/ninf: see module docstring

# Layout of the small typed constant arrays handed to the float statistics kernels
# (built by engine.numerics.statistics._float_consts; typed like the integer views of the input):
#   sc (signed view's dtype):   [LIM, SMIN, SMAX]
#   uc (unsigned view's dtype): [ABSMASK, LIM, NEGLIM, 0]
# LIM is the bit pattern of +Inf (every larger magnitude is a NaN), NEGLIM that of -Inf,
# ABSMASK clears the sign bit, SMIN/SMAX are the signed type's limits (identities of the
# max/min reductions; SMIN is also the pattern of -0.0).


# --------------------------------------------------------------------------- widening


def _bf16_bits(h):
    """float32 bit pattern of the BF16 bit pattern ``h``: bfloat16 is the top half of a
    float32.  Plain Python here (``NUMBA_DISABLE_JIT=1``); compiled code uses the 32-bit
    intrinsic below."""
    return np.uint32(np.uint32(h) << np.uint32(16))


@intrinsic
def _bf16_bits_i32(typingctx, h):
    # Numba widens integer arithmetic to 64 bits, which halves the vector width of the
    # shift; in LLVM's own 32-bit ops the widening loop runs about twice as fast.
    if not (isinstance(h, types.Integer) and h.bitwidth == 16):
        return None

    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.shl(wide, ir.Constant(ir.IntType(32), 16))

    return types.uint32(h), codegen


@overload(_bf16_bits)
def _bf16_bits_jit(h):
    return lambda h: _bf16_bits_i32(h)


def _host_converts_half() -> bool:
    """Whether LLVM turns ``fpext half -> float`` into an instruction for the CPU Numba
    compiles for (x86 with F16C, any aarch64) rather than a call into a runtime library
    the JIT lacks.  ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES`` (portable caches) are
    honoured: a named CPU converts only if its listed features include ``+f16c``."""
    try:
        import llvmlite.binding as llb
        from numba.core import config

        triple = llb.get_process_triple()
        if triple.startswith(("aarch64", "arm64")):
            return True
        if not triple.startswith("x86_64"):
            return False
        if config.CPU_NAME and config.CPU_NAME != "host":
            return "+f16c" in (config.CPU_FEATURES or "").split(",")
        return bool(llb.get_host_cpu_features().get("f16c"))
    except Exception:  # an llvmlite that cannot tell: keep the portable integer path
        return False


#: F16 is widened by the CPU's own conversion (one ``vcvtph2ps`` per 8 values on x86)
#: instead of integer bit arithmetic: faster F16 statistics (``scripts/bench_kernels.py --only stats_f16``).  Frozen
#: into compiled code; Numba's cache is keyed on the target CPU and its features, so the
#: two paths never mix.
_F16_NATIVE = _host_converts_half()


def _f16_bits(h):
    """float32 bit pattern of the F16 bit pattern ``h`` (int), exact for every input; a
    NaN keeps its sign and payload and comes out quiet, as an IEEE conversion (and F16C)
    delivers it.  Plain Python: the reference for both compiled paths of
    :func:`widen_half`."""
    h = int(h)
    sign = (h & 0x8000) << 16
    em = h & 0x7FFF
    if em >= 0x7C00:  # Inf, NaN
        return np.uint32(sign | 0x7F800000 | ((em & 0x3FF) << 13) | (0x400000 if em > 0x7C00 else 0))
    if em >= 0x0400:  # normal: rebias the exponent from 15 to 127
        return np.uint32(sign | ((em << 13) + 0x38000000))
    if em == 0:
        return np.uint32(sign)
    shift = 11 - em.bit_length()  # subnormal m * 2**-24: normalise the mantissa
    return np.uint32(sign | (((em << shift) & 0x3FF) << 13) | ((113 - shift) << 23))


@intrinsic
def _f16_value(typingctx, h):
    # the CPU's own half -> float conversion (exact: every half is a float)
    if not (isinstance(h, types.Integer) and h.bitwidth == 16):
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@njit(**_OPTS)
def widen_half(fmt, src, out, bits):
    """Widen ``uint16`` F16/BF16 bit patterns in ``src`` to float32 in ``out[:src.size]``.

    ``bits`` is the ``uint32`` view of ``out``: the conversion is exact for every input,
    subnormals and infinities included.  A NaN keeps its sign and payload; F16 NaNs come
    out quiet (an IEEE conversion signals on a signalling NaN and delivers it quiet; BF16
    is only the top half of a float32, so its NaNs are kept bit for bit).
    """
    n = src.size
    if fmt == BF16:
        for j in range(n):
            bits[j] = _bf16_bits(src[j])
        return
    if _F16_NATIVE:
        _widen_f16_native(src, out, bits)
    else:
        _widen_f16_portable(src, out, bits)


@njit(**_OPTS)
def _widen_f16_portable(src, out, bits):
    """F16 widening in integer bit arithmetic, for hosts whose CPU has no conversion."""
    n = src.size
    nsub = 0
    for j in range(n):
        h = np.int64(src[j])
        em = h & 0x7FFF
        # Rebias the exponent from 15 to 127 (+112 << 23); Inf/NaN (exponent 31) go to 255
        # with the payload kept (and a NaN made quiet); subnormals are given exponent 1 here
        # and fixed below.
        if em > 0x7C00:
            adj = 0x70000000
            quiet = 0x400000
        elif em == 0x7C00:
            adj = 0x70000000
            quiet = 0
        elif em >= 0x0400:
            adj = 0x38000000
            quiet = 0
        else:
            adj = 0x38800000
            quiet = 0
        b = ((em << 13) + adj) | quiet if em != 0 else 0
        nsub += (em != 0) & (em < 0x0400)
        bits[j] = ((h & 0x8000) << 16) | b
    if nsub:
        # A subnormal half m * 2**-24 was written as +-(2**-14 + m * 2**-24); subtracting
        # 2**-14 is exact (Sterbenz) and leaves the right value.  Rare, so a second loop.
        two_m14 = np.float32(2.0**-14)
        for j in range(n):
            em = np.int64(src[j]) & 0x7FFF
            if em != 0 and em < 0x0400:
                f = out[j]
                out[j] = f - two_m14 if f > 0 else f + two_m14


def _widen_f16_native(src, out, bits):
    """Plain Python (``NUMBA_DISABLE_JIT=1``): the bit-exact reference conversion."""
    for j in range(src.size):
        bits[j] = _f16_bits(src[j])


@overload(_widen_f16_native)
def _widen_f16_native_jit(src, out, bits):
    def impl(src, out, bits):
        for j in range(src.size):
            out[j] = _f16_value(src[j])

    return impl


# --------------------------------------------------------------------------- statistics


def chan(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Merge (count, mean, M2) of two disjoint sets (Chan, Golub & LeVeque).

    Written once for both targets, as :func:`fold_one` is (and pinned the same way in
    ``cuda_kernels.SHARED_SHA256``)."""
    if n_b == 0:
        return n_a, mean_a, m2_a
    if n_a == 0:
        return n_b, mean_b, m2_b
    n = n_a + n_b
    d = mean_b - mean_a
    frac = float(n_b) / float(n)
    if math.isfinite(d):
        mean = mean_a + d * frac
    else:  # float64 data near the overflow threshold: the weighted form cannot overflow
        mean = mean_a * (float(n_a) / float(n)) + mean_b * frac
    return n, mean, m2_a + m2_b + d * d * (float(n_a) * frac)


_chan = njit(**_OPTS)(chan)


@njit(**_OPTS)
def _keys(ki, ku):
    """Ordering keys of a float tile: max and min of the signed view of its bit patterns,
    max and min of the unsigned view.

    Integer min/max reductions vectorize without fast-math (a float min/max does not:
    LLVM would need to assume no NaN); engine.numerics.statistics decodes the float min and max from the
    keys.  They also tell, exactly and for free, whether the tile holds a NaN or an Inf
    (patterns at or above +-Inf's) and whether it holds a zero: +0.0 is the smallest
    unsigned pattern, -0.0 the smallest signed one.  Pure comparisons on purpose: Numba
    widens ``uint32 & uint32`` to uint64, which would halve the vector width.
    """
    max_i = ki[0]
    min_i = ki[0]
    max_u = ku[0]
    min_u = ku[0]
    for i in range(ki.size):
        k = ki[i]
        u = ku[i]
        max_i = k if k > max_i else max_i
        min_i = k if k < min_i else min_i
        max_u = u if u > max_u else max_u
        min_u = u if u < min_u else min_u
    return max_i, min_i, max_u, min_u


@njit(**_OPTS, fastmath=_MOMENT_MATH)
def _sums(f):
    """Mean and M2 of a tile of finite values (or integers), summed around d = x - x[0].

    mean = x[0] + sum(d) / n and M2 = sum(d**2) - sum(d)**2 / n.  Any shift inside
    [min, max] keeps that subtraction sound: n * (mean - shift)**2 <= n * range**2 <=
    2 * n * M2, so it loses at most log2(2 n) bits -- 13 of float64's 53 for a
    4096-element tile.  A separate sweep from :func:`_keys` (the tile is in L1 by then):
    LLVM vectorizes the two loops apart much better than one loop mixing both.
    """
    shift = np.float64(f[0])
    sd = 0.0
    sd2 = 0.0
    for i in range(f.size):
        d = np.float64(f[i]) - shift
        sd += d
        sd2 += d * d
    n = f.size
    m2 = sd2 - sd * (sd / n)
    return shift + sd / n, m2 if m2 > 0.0 else 0.0


@njit(**_OPTS, fastmath=_MOMENT_MATH)
def _raw_sums(f):
    """Sums of x and x**2 in float64 over a tile of finite values: the unshifted sums that
    :func:`_fold` adds up over a whole block and checks once in :func:`_settle`."""
    s = 0.0
    s2 = 0.0
    for i in range(f.size):
        x = np.float64(f[i])
        s += x
        s2 += x * x
    return s, s2


@njit(**_OPTS)
def _zeros(f):
    """Number of elements equal to zero (-0.0 == 0.0); only run on tiles that have one."""
    nz = 0
    for i in range(f.size):
        nz += f[i] == 0
    return nz


def fold_one(u, k, v, absmask, lim, nfin, nnan, npos, nneg, nz, max_i, min_i, max_u, shift, sd, sd2):
    """One element of the statistics fold: ``u`` its bits (uint64), ``k`` the same bits
    signed (int64), ``v`` its value (float64).  NaN and the infinities are counted; a finite
    value moves the extremes of the bit keys, the zero count and the sums of differences
    from the first finite value (``shift``).  Returns the updated state.

    Written once for both targets: compiled here for the CPU kernels and, as a CUDA device
    function, by :mod:`engine.numerics.cuda_kernels` for ``stats_fold``.  Numba's on-disk
    cache checks only the file that defines a kernel, so ``cuda_kernels`` pins the source
    of this function, :func:`moments` and :func:`chan` in ``SHARED_SHA256``; a test fails until an edit here
    is recorded there, and that edit recompiles the cached device kernels.
    """
    a = u & absmask
    if a > lim:
        nnan += 1
    elif a == lim:
        if u == a:
            npos += 1
        else:
            nneg += 1
    else:
        max_i = k if k > max_i else max_i
        min_i = k if k < min_i else min_i
        max_u = u if u > max_u else max_u
        if nfin == 0:
            shift = v
        nfin += 1
        if v == 0:
            nz += 1
        d = v - shift
        sd += d
        sd2 += d * d
    return nfin, nnan, npos, nneg, nz, max_i, min_i, max_u, shift, sd, sd2


def moments(nfin, shift, sd, sd2, empty):
    """(mean, M2) of the ``nfin`` finite values :func:`fold_one` summed (``empty`` as the
    mean of none); shared with the device kernels as :func:`fold_one` is."""
    mean = empty
    m2 = 0.0
    if nfin > 0:
        mean = shift + sd / nfin
        m2 = sd2 - sd * (sd / nfin)
        if m2 < 0.0:
            m2 = 0.0
    return mean, m2


_fold_one = njit(inline="always", **_OPTS)(fold_one)
_moments = njit(inline="always", **_OPTS)(moments)


@njit(**_OPTS)
def _classify(f, ki, ku, sc, uc):
    """Slow path for a tile holding NaN or Inf: count them and reduce the finite values.

    Returns (max_i, min_i, max_u, n_finite, n_nan, n_posinf, n_neginf, n_zero, mean, m2).
    """
    absmask = np.uint64(uc[0])
    lim_u = np.uint64(uc[1])
    max_i = np.int64(sc[1])
    min_i = np.int64(sc[2])
    max_u = np.uint64(uc[3])
    nfin = 0
    nnan = 0
    npos = 0
    nneg = 0
    nz = 0
    shift = 0.0
    sd = 0.0
    sd2 = 0.0
    for i in range(ki.size):
        nfin, nnan, npos, nneg, nz, max_i, min_i, max_u, shift, sd, sd2 = _fold_one(
            np.uint64(ku[i]), np.int64(ki[i]), np.float64(f[i]), absmask, lim_u,
            nfin, nnan, npos, nneg, nz, max_i, min_i, max_u, shift, sd, sd2)
    mean, m2 = _moments(nfin, shift, sd, sd2, np.nan)
    return max_i, min_i, max_u, nfin, nnan, npos, nneg, nz, mean, m2


@njit(**_OPTS)
def _fold_keys(max_i, min_i, max_u, skey, ukey):
    skey[0] = max_i if max_i > skey[0] else skey[0]
    skey[1] = min_i if min_i < skey[1] else skey[1]
    ukey[0] = max_u if max_u > ukey[0] else ukey[0]


@njit(**_OPTS)
def _fold_moments(n, mean, m2, cnt, mom):
    """Merge (n, mean, M2) of finite values into ``cnt[0]`` and ``mom``."""
    _, mean, m2 = _chan(np.float64(cnt[0]), mom[0], mom[1], np.float64(n), mean, m2)
    cnt[0] += n
    mom[0] = mean
    mom[1] = m2


@njit(**_OPTS)
def _all_finite(max_i, max_u, sc, uc):
    return max_i < sc[0] and max_u < uc[2]  # below +Inf and below -Inf


class Acc(NamedTuple):
    """Accumulators of one block of float statistics, owned by the caller: ``cnt``
    [finite, nan, +inf, -inf, zero] (int64), ``mom`` [mean, M2] (float64), ``skey``
    [max_i, min_i] (signed view's type) and ``ukey`` [max_u] (unsigned view's type)."""

    cnt: Any
    mom: Any
    skey: Any
    ukey: Any


@njit(**_OPTS)
def _float_tile(f, ki, ku, sc, uc, acc):
    """Fold one tile (``f`` floats, ``ki``/``ku`` the same elements' bit patterns) into the
    block accumulators ``cnt`` [finite, nan, +inf, -inf, zero], ``mom`` [mean, M2],
    ``skey`` [max_i, min_i] and ``ukey`` [max_u] of ``acc``, with the moments summed
    around the tile's first value (:func:`_sums`)."""
    cnt = acc.cnt
    max_i, min_i, max_u, min_u = _keys(ki, ku)
    if _all_finite(max_i, max_u, sc, uc):
        nfin = f.size
        mean, m2 = _sums(f)
        if min_u == uc[3] or min_i == sc[1]:  # +0.0 or -0.0 present
            cnt[4] += _zeros(f)
    else:
        max_i, min_i, max_u, nfin, nnan, npos, nneg, nz, mean, m2 = _classify(f, ki, ku, sc, uc)
        cnt[1] += nnan
        cnt[2] += npos
        cnt[3] += nneg
        cnt[4] += nz
        if nfin == 0:
            return
    _fold_moments(nfin, mean, m2, cnt, acc.mom)
    _fold_keys(max_i, min_i, max_u, acc.skey, acc.ukey)


@njit(**_OPTS)
def _raw_tile(f, ki, ku, sc, uc, acc):
    """Fast path of :func:`_fold`: for an all-finite tile fold its keys and zeros and return
    ``(True, sum x, sum x**2)``; otherwise change nothing and return ``(False, 0, 0)``."""
    max_i, min_i, max_u, min_u = _keys(ki, ku)
    if not _all_finite(max_i, max_u, sc, uc):
        return False, 0.0, 0.0
    s, s2 = _raw_sums(f)
    if min_u == uc[3] or min_i == sc[1]:  # +0.0 or -0.0 present
        acc.cnt[4] += _zeros(f)
    _fold_keys(max_i, min_i, max_u, acc.skey, acc.ukey)
    return True, s, s2


#: Unshifted sums are kept when sum(x**2) <= this * M2, i.e. when M2 = sum(x**2) - n mean**2
#: loses at most log2 of it (8 bits of float64's 53); otherwise the block is summed again
#: around each tile's first value (:func:`_sums`).
_UNSHIFTED_RATIO = 256.0


@njit(**_OPTS)
def _settle(n, s, s2, cnt, mom):
    """Merge the unshifted sums of ``n`` finite values if they are sound; False (nothing
    merged) when the cancellation in sum(x**2) - n mean**2 would cost more than
    :data:`_UNSHIFTED_RATIO` allows, or the squares overflowed."""
    if n == 0:
        return True
    mean = s / n
    m2 = s2 - s * mean
    if not (np.isfinite(s2) and s2 <= _UNSHIFTED_RATIO * m2):  # s2 == 0: all zeros, m2 == 0
        return False
    _fold_moments(n, mean, m2, cnt, mom)
    return True


@njit(**_OPTS)
def _near_zero(cnt, mom):
    """Whether unshifted sums are expected to pass :func:`_settle` for more data like that
    already folded: none yet, or a running mean within a few standard deviations of 0."""
    n = cnt[0]
    return n == 0 or mom[0] * mom[0] * n <= 0.25 * _UNSHIFTED_RATIO * mom[1]


def _tile_values(fmt, f, ku, t0, t1, buf, bits):
    """The tile ``[t0, t1)`` as floats: a slice of ``f`` when there is no scratch ``buf``
    (float data), else the F16/BF16 patterns ``ku`` widened into ``buf``."""
    if buf is None:
        return f[t0:t1]
    widen_half(fmt, ku[t0:t1], buf, bits)
    return buf[: t1 - t0]


@overload(_tile_values)
def _tile_values_jit(fmt, f, ku, t0, t1, buf, bits):
    # chosen by type when compiling, so float data never compiles the widening
    if isinstance(buf, types.NoneType):
        return lambda fmt, f, ku, t0, t1, buf, bits: f[t0:t1]

    def widened(fmt, f, ku, t0, t1, buf, bits):
        widen_half(fmt, ku[t0:t1], buf, bits)
        return buf[: t1 - t0]

    return widened


@njit(**_OPTS)
def _fold(fmt, f, ki, ku, sc, uc, lo, hi, tile, buf, bits, acc):
    """Fold elements ``[lo, hi)`` into the accumulators of :func:`_float_tile`.

    Data near zero (every weight matrix) is summed without a shift: each all-finite tile
    adds its raw sums, and the block merges once (:func:`_settle`).  A tile holding NaN or
    Inf goes through :func:`_classify`; a block whose unshifted sums would lose precision is
    summed again tile by tile around a shift, and later blocks of the same accumulator go
    there directly (:func:`_near_zero`).  The first tile of a fresh accumulator is summed
    around a shift, so that its mean and spread predict the rest: a block of data far from
    zero (norm weights near 1) is then never summed twice.
    """
    cnt = acc.cnt
    mom = acc.mom
    if cnt[0] == 0 and lo < hi:
        t1 = min(lo + tile, hi)
        _float_tile(_tile_values(fmt, f, ku, lo, t1, buf, bits), ki[lo:t1], ku[lo:t1], sc, uc, acc)
        lo = t1
    if _near_zero(cnt, mom):
        n = 0
        s = 0.0
        s2 = 0.0
        for t0 in range(lo, hi, tile):
            t1 = min(t0 + tile, hi)
            v = _tile_values(fmt, f, ku, t0, t1, buf, bits)
            ok, a, b = _raw_tile(v, ki[t0:t1], ku[t0:t1], sc, uc, acc)
            if ok:
                n += t1 - t0
                s += a
                s2 += b
            else:
                _float_tile(v, ki[t0:t1], ku[t0:t1], sc, uc, acc)
        if _settle(n, s, s2, cnt, mom):
            return
        # the keys and zeros of the all-finite tiles are in; only their moments are redone
        for t0 in range(lo, hi, tile):
            t1 = min(t0 + tile, hi)
            max_i, _, max_u, _ = _keys(ki[t0:t1], ku[t0:t1])
            if _all_finite(max_i, max_u, sc, uc):
                mean, m2 = _sums(_tile_values(fmt, f, ku, t0, t1, buf, bits))
                _fold_moments(t1 - t0, mean, m2, cnt, mom)
        return
    for t0 in range(lo, hi, tile):
        t1 = min(t0 + tile, hi)
        _float_tile(_tile_values(fmt, f, ku, t0, t1, buf, bits), ki[t0:t1], ku[t0:t1], sc, uc, acc)


@njit(**_OPTS)
def init_keys(sc, uc, skey, ukey):
    """Identities of the key reductions, for every block row of ``skey`` (n, 2) / ``ukey`` (n,)
    (or a single accumulator: ``skey`` (2,), ``ukey`` (1,))."""
    skey[..., 0] = sc[1]
    skey[..., 1] = sc[2]
    ukey[:] = uc[3]


@njit(**_OPTS)
def merge_float_blocks(cnt, mom, skey, ukey):
    """Merge partial-result rows (``cnt`` [n, 5], ``mom`` [n, 2], ``skey`` [n, 2], ``ukey``
    [n]; see :func:`fold_block`) into the tuple :func:`stats_values` returns.  Also merges
    the rows that the device kernels of :mod:`engine.numerics.cuda_kernels` fill."""
    n = 0.0
    mean = np.nan
    m2 = 0.0
    tot = np.zeros(5, np.int64)
    max_i = skey[0, 0]
    min_i = skey[0, 1]
    max_u = ukey[0]
    for b in range(cnt.shape[0]):
        for j in range(5):
            tot[j] += cnt[b, j]
        if cnt[b, 0] > 0:
            n, mean, m2 = _chan(n, mean, m2, np.float64(cnt[b, 0]), mom[b, 0], mom[b, 1])
            max_i = skey[b, 0] if skey[b, 0] > max_i else max_i
            min_i = skey[b, 1] if skey[b, 1] < min_i else min_i
            max_u = ukey[b] if ukey[b] > max_u else max_u
    return tot[0], tot[1], tot[2], tot[3], tot[4], mean, m2, max_i, min_i, max_u


def _values_block(fmt, f, ki, ku, sc, uc, lo, hi, tile, acc):
    """:func:`fold_block` body.  Plain Python here (``NUMBA_DISABLE_JIT=1``); compiled code
    picks one of the two branches by the dtype of ``f`` (below)."""
    if f.dtype == np.uint16:
        buf = np.empty(tile, np.float32)  # per-task scratch: one tile, never the tensor
        _fold(fmt, buf, ki, ku, sc, uc, lo, hi, tile, buf, buf.view(np.uint32), acc)
    else:
        _fold(FLOAT, f, ki, ku, sc, uc, lo, hi, tile, None, None, acc)


@overload(_values_block)
def _values_block_jit(fmt, f, ki, ku, sc, uc, lo, hi, tile, acc):
    # chosen by type when compiling, so float data never compiles the widening
    if f.dtype == types.uint16:

        def widened(fmt, f, ki, ku, sc, uc, lo, hi, tile, acc):
            buf = np.empty(tile, np.float32)
            _fold(fmt, buf, ki, ku, sc, uc, lo, hi, tile, buf, buf.view(np.uint32), acc)

        return widened
    return lambda fmt, f, ki, ku, sc, uc, lo, hi, tile, acc: _fold(
        FLOAT, f, ki, ku, sc, uc, lo, hi, tile, None, None, acc)


@njit(**_OPTS)
def fold_block(fmt, f, ki, ku, sc, uc, lo, hi, tile, acc):
    """Fold elements ``[lo, hi)`` into the accumulators ``acc`` (:class:`Acc`, see
    :func:`_fold`); the caller sets them up once with :func:`init_keys`, so a block can be
    fed in any number of calls.

    ``f`` holds the values: float32 or float64 (``fmt`` is then ignored), or F16
    (``fmt=F16``) / BF16 (``fmt=BF16``) bit patterns as ``uint16``, widened a tile at a
    time into a per-call float32 scratch buffer.  ``ki``/``ku`` are the signed and unsigned
    integer views of the same memory.
    """
    _values_block(fmt, f, ki, ku, sc, uc, lo, hi, tile, acc)


@njit(**_OPTS)
def _float_partials(n, block, ki, ku, sc, uc):
    """Number of blocks of ``n`` elements and their zeroed partial-result rows (see
    :func:`fold_block`), for :func:`stats_values`."""
    nb = (n + block - 1) // block
    cnt = np.zeros((max(nb, 1), 5), np.int64)
    mom = np.zeros((max(nb, 1), 2))
    skey = np.empty((max(nb, 1), 2), ki.dtype)
    ukey = np.empty(max(nb, 1), ku.dtype)
    init_keys(sc, uc, skey, ukey)
    return nb, cnt, mom, skey, ukey


@njit(**_OPTS, parallel=True)
def stats_values(fmt, f, ki, ku, sc, uc, block, tile, parallel):
    """Fused statistics of float32, float64, F16 or BF16 data.

    Parameters
    ----------
    fmt, f : the values, as for :func:`fold_block`
    ki, ku : the same memory viewed as the signed and unsigned integer of its width
    sc, uc : typed constants, see the layout note at the top of this module
    block, tile : elements per parallel task and per cache-resident tile
    parallel : use Numba's thread pool (``prange``) or only the calling thread

    Returns
    -------
    (n_finite, n_nan, n_posinf, n_neginf, n_zero, mean, m2, max_i, min_i, max_u)
        Over the finite values; the keys (bit patterns of the source format) are decoded
        to min/max by engine.numerics.statistics.
    """
    n = f.size
    nb, cnt, mom, skey, ukey = _float_partials(n, block, ki, ku, sc, uc)
    if parallel:
        for b in prange(nb):
            lo = b * block
            fold_block(fmt, f, ki, ku, sc, uc, lo, min(lo + block, n), tile, Acc(cnt[b], mom[b], skey[b], ukey[b:]))
    else:
        for b in range(nb):
            lo = b * block
            fold_block(fmt, f, ki, ku, sc, uc, lo, min(lo + block, n), tile, Acc(cnt[b], mom[b], skey[b], ukey[b:]))
    return merge_float_blocks(cnt, mom, skey, ukey)


@njit(**_OPTS)
def _int_tile(t):
    """min, max and zeros of an integer tile (its moments come from :func:`_sums`)."""
    mn = t[0]
    mx = t[0]
    nz = 0
    for i in range(t.size):
        v = t[i]
        mn = v if v < mn else mn
        mx = v if v > mx else mx
        nz += v == 0
    return mn, mx, nz


@njit(**_OPTS)
def int_block(x, lo, hi, tile, cnt, mom, ext):
    """Fold ``x[lo:hi]`` into ``cnt`` [n, zeros], ``mom`` [mean, M2] and ``ext`` [min, max]
    (set from the first tile while ``cnt[0] == 0``)."""
    for t0 in range(lo, hi, tile):
        t = x[t0 : min(t0 + tile, hi)]
        mn, mx, nz = _int_tile(t)
        mean, m2 = _sums(t)
        if cnt[0] == 0:
            ext[0] = mn
            ext[1] = mx
        else:
            ext[0] = mn if mn < ext[0] else ext[0]
            ext[1] = mx if mx > ext[1] else ext[1]
        n, mean, m2 = _chan(np.float64(cnt[0]), mom[0], mom[1], np.float64(t.size), mean, m2)
        cnt[0] += t.size
        cnt[1] += nz
        mom[0] = mean
        mom[1] = m2


@njit(**_OPTS, parallel=True)
def stats_int(x, block, tile, parallel):
    """Fused statistics of an integer array (bool as ``uint8``).

    Returns ``(n, n_zero, mean, m2, min, max)``; min and max keep the input's type (exact
    for 64-bit values), mean and M2 are float64.  ``n == 0`` for an empty array, in which
    case min and max are meaningless.
    """
    n = x.size
    nb = (n + block - 1) // block
    cnt = np.zeros((max(nb, 1), 2), np.int64)
    mom = np.zeros((max(nb, 1), 2))
    ext = np.zeros((max(nb, 1), 2), x.dtype)
    if parallel:
        for b in prange(nb):
            lo = b * block
            int_block(x, lo, min(lo + block, n), tile, cnt[b], mom[b], ext[b])
    else:
        for b in range(nb):
            lo = b * block
            int_block(x, lo, min(lo + block, n), tile, cnt[b], mom[b], ext[b])
    tot = 0.0
    nzero = 0
    mean = np.nan
    m2 = 0.0
    mn = ext[0, 0]
    mx = ext[0, 1]
    for b in range(nb):
        tot, mean, m2 = _chan(tot, mean, m2, np.float64(cnt[b, 0]), mom[b, 0], mom[b, 1])
        nzero += cnt[b, 1]
        mn = ext[b, 0] if ext[b, 0] < mn else mn
        mx = ext[b, 1] if ext[b, 1] > mx else mx
    return n, nzero, mean, m2, mn, mx


# --------------------------------------------------------------------------- reading while summarising
#
# A streaming load summarises each tensor as it lands.  Summarising a 16 MiB read request
# after the read means fetching it back from memory; these kernels instead read a piece in
# windows of a few hundred KiB with pread(2) and fold each window into the accumulators
# while it is still in the core's L2, all in one call without the GIL.


def _pread(fd, buf, offset):
    """One ``pread(2)`` into the bytes of ``buf``: bytes read, 0 at end of file, -1 on error.

    Plain Python here (``NUMBA_DISABLE_JIT=1``); compiled code calls libc directly.
    """
    try:
        return os.preadv(fd, [buf], offset)
    except OSError:
        return -1


@intrinsic
def _pread_libc(typingctx, fd, buf, offset):
    # Declared by name and resolved when the code is loaded, so the function stays cacheable
    # (a ctypes function pointer would bake an address into the cached code).
    if not (isinstance(buf, types.Array) and buf.ndim == 1 and buf.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        fd_v, buf_v, off_v = args
        ary = context.make_array(signature.args[1])(context, builder, buf_v)
        i64 = ir.IntType(64)
        char_p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i64, [ir.IntType(32), char_p, i64, i64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "pread")
        nbytes = builder.mul(ary.nitems, ir.Constant(i64, signature.args[1].dtype.bitwidth // 8))
        data = builder.bitcast(ary.data, char_p)
        return builder.call(fn, [builder.trunc(fd_v, ir.IntType(32)), data, nbytes, off_v])

    return types.int64(fd, buf, offset), codegen


@overload(_pread)
def _pread_jit(fd, buf, offset):
    return lambda fd, buf, offset: _pread_libc(fd, buf, offset)


@njit(**_OPTS)
def _read_full(fd, buf, offset):
    """Read ``buf.size`` bytes at ``offset``; returns the bytes read, fewer on end of file or
    error (the caller re-reads the rest through the Python reader, which names the error)."""
    done = 0
    n = buf.size
    while done < n:
        got = _pread(fd, buf[done:], offset + done)
        if got <= 0:
            break
        done += got
    return done


@njit(**_OPTS)
def read_fold(fd, offset, dest, window, fmt, like, sc, uc, tile, acc):
    """Read ``dest.size`` bytes at file ``offset`` into the byte array ``dest``, ``window``
    bytes at a time, folding each window into the accumulators of :func:`fold_block`; the
    values are of the dtype of ``like`` (float32, float64, or ``uint16`` for F16/BF16 with
    ``fmt``).

    ``window`` is a multiple of the item size and ``dest.size`` a multiple of it.  Returns
    the bytes read and folded: ``dest.size``, or less after a short read (that window is not
    folded; the caller reads and folds the rest itself).
    """
    n = dest.size
    for pos in range(0, n, window):
        w = dest[pos : min(pos + window, n)]
        if _read_full(fd, w, offset + pos) < w.size:
            return pos
        f = w.view(like.dtype)
        fold_block(fmt, f, w.view(sc.dtype), w.view(uc.dtype), sc, uc, 0, f.size, tile, acc)
    return n


@njit(**_OPTS)
def read_fold_int(fd, offset, dest, window, tile, cnt, mom, ext):
    """:func:`read_fold` for integers of the type of ``ext`` (bool as ``uint8``),
    folded into the accumulators of :func:`int_block`."""
    n = dest.size
    for pos in range(0, n, window):
        w = dest[pos : min(pos + window, n)]
        if _read_full(fd, w, offset + pos) < w.size:
            return pos
        x = w.view(ext.dtype)
        int_block(x, 0, x.size, tile, cnt, mom, ext)
    return n


# --------------------------------------------------------------------------- quantization
#
# A tensor to quantize is seen as (outer, C, inner): C channels (C == 1 per tensor), each
# channel c made of the ``outer`` contiguous runs x[o, c, :] of ``inner`` elements.  Work is
# cut into a grid of tasks of oc x cc x ic (o, c, i) elements, sized by the caller so that a
# task holds about ``block`` elements and the per-task partial maxima stay small.
# Partial maxima of a task live in part[row, c] with row = o_task * n_i_tasks + i_task.
#
# One definition per pass for every input format: ``x`` holds float32 values, or F16/BF16
# bit patterns as ``uint16`` (``fmt``) that are widened a tile at a time into a per-task
# float32 scratch buffer (:func:`_scratch`, :func:`_tile_values`, chosen by type when
# compiling, so float32 input never compiles the widening).


class Grid(NamedTuple):
    """The (outer, C, inner) view of a tensor and its task extents (oc, cc, ic)."""

    outer: int
    C: int
    inner: int
    oc: int
    cc: int
    ic: int


class Keys(NamedTuple):
    """Bit-pattern constants of an input format, typed like its unsigned view: ``absmask``
    clears the sign bit, ``lim`` is +Inf (larger magnitudes are NaN), ``sign`` the sign bit."""

    absmask: Any
    lim: Any
    sign: Any


@njit(**_OPTS)
def _task(t, g):
    pc = (g.C + g.cc - 1) // g.cc
    pi = (g.inner + g.ic - 1) // g.ic
    a = t // (pc * pi)
    r = t - a * (pc * pi)
    b = r // pi
    d = r - b * pi
    o0 = a * g.oc
    c0 = b * g.cc
    i0 = d * g.ic
    return o0, min(o0 + g.oc, g.outer), c0, min(c0 + g.cc, g.C), i0, min(i0 + g.ic, g.inner), a * pi + d


@njit(**_OPTS)
def _max_mag(ki, ku, absmask, sign):
    """Largest magnitude in a segment, as a bit-pattern key (``pattern & absmask``).

    Two pure comparison reductions, as in :func:`_keys`: the signed max is the largest
    non-negative value, the unsigned max (when it has the sign bit) the most negative one.
    Reducing ``pattern & absmask`` directly would be slower, Numba widening it to uint64.
    """
    mi = ki[0]
    mu = ku[0]
    for i in range(ki.size):
        k = ki[i]
        u = ku[i]
        mi = k if k > mi else mi
        mu = u if u > mu else mu
    pos = np.uint64(mi) if mi > 0 else np.uint64(0)
    neg = np.uint64(mu) & np.uint64(absmask) if mu >= sign else np.uint64(0)
    return pos if pos > neg else neg


@njit(**_OPTS)
def _count_nonfinite(ku, absmask, lim, bad):
    """Max magnitude key over the finite values of ``ku``; NaN, +Inf, -Inf counted in bad."""
    m = absmask & 0
    for i in range(ku.size):
        u = ku[i]
        a = u & absmask
        if a > lim:
            bad[0] += 1
        elif a == lim:
            if u == a:
                bad[1] += 1
            else:
                bad[2] += 1
        else:
            m = a if a > m else m
    return m


@njit(**_OPTS)
def _absmax_task(ki, ku, keys, g, t, part, bad):
    o0, o1, c0, c1, i0, i1, row = _task(t, g)
    C = g.C
    inner = g.inner
    absmask = keys.absmask
    lim = keys.lim
    prow = part[row]
    if inner == 1:
        # one element per (o, c): vectorize across channels
        for o in range(o0, o1):
            seg = ku[o * C + c0 : o * C + c1]
            acc = prow[c0:c1]
            for j in range(seg.size):
                a = seg[j] & absmask
                acc[j] = a if a > acc[j] else acc[j]
        anybad = False
        for c in range(c0, c1):
            anybad |= prow[c] >= lim
        if anybad:  # rare: redo the task, counting NaN/Inf and keeping them out of the max
            for c in range(c0, c1):
                prow[c] = 0
            for o in range(o0, o1):
                for c in range(c0, c1):
                    m = _count_nonfinite(ku[o * C + c : o * C + c + 1], absmask, lim, bad)
                    prow[c] = m if m > prow[c] else prow[c]
        return
    for o in range(o0, o1):
        for c in range(c0, c1):
            base = (o * C + c) * inner
            seg = ku[base + i0 : base + i1]
            m = _max_mag(ki[base + i0 : base + i1], seg, absmask, keys.sign)
            if m >= lim:
                m = _count_nonfinite(seg, absmask, lim, bad)
            prow[c] = m if m > prow[c] else prow[c]


@njit(**_OPTS, parallel=True)
def absmax_grid(ki, ku, keys, g, parallel):
    """Per-channel maximum magnitude of the finite values, as bit-pattern keys.

    ``ki``/``ku`` are the signed and unsigned views of float32 (``int32``/``uint32``) or
    F16/BF16 (``int16``/``uint16``) data; ``keys`` (:class:`Keys`) holds the format's
    constants typed like ``ku``, ``g`` (:class:`Grid`) the layout and task extents.
    Magnitude order equals the order of ``pattern & absmask`` for every IEEE-like format,
    subnormals included, so no value is widened.

    Returns ``(part, bad)``: ``part[rows, C]`` partial maxima (reduce with ``max(axis=0)``),
    ``bad[tasks, 3]`` counts of NaN, +Inf and -Inf.
    """
    po = (g.outer + g.oc - 1) // g.oc
    pc = (g.C + g.cc - 1) // g.cc
    pi = (g.inner + g.ic - 1) // g.ic
    ntask = po * pc * pi
    part = np.zeros((max(po * pi, 1), g.C), ku.dtype)
    bad = np.zeros((max(ntask, 1), 3), np.int64)
    if parallel:
        for t in prange(ntask):
            _absmax_task(ki, ku, keys, g, t, part, bad[t])
    else:
        for t in range(ntask):
            _absmax_task(ki, ku, keys, g, t, part, bad[t])
    return part, bad


def _scale_at(s, j):
    """Scale of element ``j``: ``s`` itself (one scale for the run) or ``s[j]`` (a scale
    per element, the ``inner == 1`` layout).  Plain Python here; compiled code picks by type."""
    return s[j] if isinstance(s, np.ndarray) else s


@overload(_scale_at)
def _scale_at_jit(s, j):
    if isinstance(s, types.Array):
        return lambda s, j: s[j]
    return lambda s, j: s


@njit(**_OPTS)
def _quant(f, s, q):
    """q = clip(rint(f / s), -127, 127) with NaN -> 0; float32 throughout, true division.
    ``s`` is one scale, or one per element."""
    lo = np.float32(-127.0)
    hi = np.float32(127.0)
    zero = np.float32(0.0)
    for j in range(f.size):
        r = np.rint(f[j] / _scale_at(s, j))
        r = r if r == r else zero  # NaN (only reaches here with on_nonfinite="clamp")
        r = r if r < hi else hi  # +Inf / s -> 127
        r = r if r > lo else lo
        q[j] = np.int8(r)


def _scratch(x, tile):
    """Per-task widening buffer and its ``uint32`` view for F16/BF16 input (``uint16``),
    ``(None, None)`` for float32.  Plain Python here; compiled code picks by type."""
    if x.dtype == np.uint16:
        buf = np.empty(tile, np.float32)
        return buf, buf.view(np.uint32)
    return None, None


@overload(_scratch)
def _scratch_jit(x, tile):
    if x.dtype == types.uint16:

        def widened(x, tile):
            buf = np.empty(tile, np.float32)
            return buf, buf.view(np.uint32)

        return widened
    return lambda x, tile: (None, None)


@njit(**_OPTS)
def _quantize_task(fmt, x, scale, g, t, tile, q):
    o0, o1, c0, c1, i0, i1, _ = _task(t, g)
    C = g.C
    inner = g.inner
    buf, bits = _scratch(x, tile)
    for o in range(o0, o1):
        if inner == 1:
            base = o * C
            for j0 in range(c0, c1, tile):
                j1 = min(j0 + tile, c1)
                v = _tile_values(fmt, x, x, base + j0, base + j1, buf, bits)
                _quant(v, scale[j0:j1], q[base + j0 : base + j1])
            continue
        for c in range(c0, c1):
            base = (o * C + c) * inner
            for j0 in range(base + i0, base + i1, tile):
                j1 = min(j0 + tile, base + i1)
                _quant(_tile_values(fmt, x, x, j0, j1, buf, bits), scale[c], q[j0:j1])


@njit(**_OPTS, parallel=True)
def quantize_grid(fmt, x, scale, g, tile, q, parallel):
    """Second pass: write int8 ``q`` (same flat layout as ``x``) given the float32
    per-channel ``scale[C]``.  ``x`` is float32, or F16/BF16 (``fmt``) as ``uint16``, widened
    ``tile`` elements at a time in L1 and then quantized exactly as float32 input."""
    po = (g.outer + g.oc - 1) // g.oc
    ntask = po * ((g.C + g.cc - 1) // g.cc) * ((g.inner + g.ic - 1) // g.ic)
    if parallel:
        for t in prange(ntask):
            _quantize_task(fmt, x, scale, g, t, tile, q)
    else:
        for t in range(ntask):
            _quantize_task(fmt, x, scale, g, t, tile, q)


# --------------------------------------------------------------------------- fused rows
#
# When every channel is one contiguous run (outer == 1: x is (C, inner), e.g. one scale per
# row of a matrix) and a run fits in L2, both passes run back to back on each run: its max
# magnitude, its scale, then its int8 values, reading x from memory once instead of twice.
# Same formula, same bits as absmax_grid + quantize_grid.


@njit(**_OPTS)
def _scale_of(amax):
    """float32(amax) / float32(127), or 1 where that is 0 (all zero, or underflow)."""
    s = amax / np.float32(127.0)
    return s if s != 0 else np.float32(1.0)


@njit(**_OPTS)
def _fused_rows_task(fmt, x, ki, ku, keys, inner, c0, c1, tile, scale, bad, q):
    buf, bits = _scratch(x, tile)
    kb = np.empty(1, ku.dtype)  # max-magnitude pattern -> float32 through a 1-element array
    for c in range(c0, c1):
        lo = c * inner
        hi = lo + inner
        m = _max_mag(ki[lo:hi], ku[lo:hi], keys.absmask, keys.sign)
        if m >= keys.lim:
            m = _count_nonfinite(ku[lo:hi], keys.absmask, keys.lim, bad)
        kb[0] = m
        s = _scale_of(_tile_values(fmt, kb.view(x.dtype), kb, 0, 1, buf, bits)[0])
        scale[c] = s
        for j0 in range(lo, hi, tile):
            j1 = min(j0 + tile, hi)
            _quant(_tile_values(fmt, x, x, j0, j1, buf, bits), s, q[j0:j1])


@njit(**_OPTS, parallel=True)
def quantize_rows_fused(fmt, x, ki, ku, keys, C, inner, cc, tile, q, parallel):
    """Per-channel quantization of ``x`` seen as (C, inner), fused per channel.

    ``x`` as for :func:`quantize_grid`; ``ki``/``ku`` its signed and unsigned integer views,
    ``keys`` (:class:`Keys`) the format's constants; ``cc`` channels per task.  Writes ``q``
    and returns ``(scale[C], bad[tasks, 3])`` (NaN, +Inf, -Inf counts).
    """
    ntask = (C + cc - 1) // cc
    scale = np.empty(C, np.float32)
    bad = np.zeros((max(ntask, 1), 3), np.int64)
    if parallel:
        for t in prange(ntask):
            _fused_rows_task(fmt, x, ki, ku, keys, inner, t * cc, min(t * cc + cc, C), tile, scale, bad[t], q)
    else:
        for t in range(ntask):
            _fused_rows_task(fmt, x, ki, ku, keys, inner, t * cc, min(t * cc + cc, C), tile, scale, bad[t], q)
    return scale, bad
