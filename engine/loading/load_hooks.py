"""Work done on tensors while a load brings them in: device statistics and int8 quantization.

:func:`plan` is the loaders' one entry point.  For a CUDA destination it returns a
:class:`LoadWork` whose hooks run the kernels of :mod:`engine.numerics.device` where the bytes land.

Through the chunk ring (:mod:`engine.gpu.device_ring`, the one device path: local and remote
files alike), in this order:

* the ring moves the file as a plain load does; tensors selected for quantization land in a
  device scratch buffer of their own source dtype (made when the ring run that holds them
  is planned), the others in their destination tensors;
* every few milliseconds the ring reports the tensors whose last copy has completed (a
  batch; Python per tensor, never per chunk) and :meth:`LoadWork.landed` launches each
  one's kernels on the load's side stream: the statistics fold of the whole tensor into
  its partial rows (an :class:`~engine.numerics.device.AccumulatorBlock` holds
  :data:`STATS_BLOCK` tensors' rows of one format, set up by one launch), and the quantization of its scratch bytes into its
  int8 values and float32 scales (three launches: channel maxima, scales, values; the
  counts and maxima they start from are zeroed once per window).  The copies of the
  following chunks go on meanwhile;
* the results are gathered without a wait per tensor (:meth:`LoadWork.gather`): the
  partial rows and NaN/Inf counts of every tensor launched so far are copied to the host
  on the side stream, one copy per block, and waited for once, when the first of them is
  handed out (or at the end of a ring run at the latest); a scratch buffer goes then.

The copies' events have completed when a tensor is reported, so the kernels need no
ordering with the ring's stream.  Device memory at peak: the int8 tensors and scales, the
unquantized tensors, and the scratch of one window of the load (:meth:`LoadWork.windows`:
:data:`STAGING_BYTES` of source bytes plus at most twice the largest tensor to quantize):
never a full-precision copy of the quantized tensors all at once.  Copies of tensor bytes: the plain load's two (page cache to chunk, chunk to device);
the kernels read the bytes where they landed.

Where Numba's CUDA target cannot run in the process (numba-cuda missing, no NVVM, a driver
it does not know: :mod:`engine.loading.kernel_probe` asks once), torch and CuPy loads do the same
work with their framework's own operations on the device
(:mod:`engine.numerics._device_fallback`), in the same order: statistics of each float
tensor and its quantization queued when it has landed, the same results, no tensor bytes
through the host (the small results come back per tensor).  Device sinks of other frameworks
take the CPU paths instead: statistics by the CPU fold (of the file's bytes as each tensor is
handed out), quantization by the
CPU kernels on each tensor as it is handed out (one device to host copy of it, and the int8
values and scales copied back).  Either way one
:class:`~engine.errors.DeviceFallbackWarning` per process says why and what to install.

For CPU destinations statistics stay with the CPU fold on the reader threads
(:class:`engine.loading.cpu_stats.StatsCollector`, the pipeline's read hook); tensors selected for quantization are quantized on the CPU by
:func:`engine.quantize_int8` as they are handed out.  Either way a quantized tensor is handed
out as a :class:`~engine.quantize.QuantizedTensor`.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.base import dtypes as _dt
from engine.errors import DeviceError, NonFiniteError, SafetensorError
from engine.loading import pipeline
from engine.loading._staging import Staging, cut_windows
from engine.loading.kernel_probe import device_kernels_unusable, warn_fallback

__all__ = ["LoadWork", "STAGING_BYTES", "plan"]

#: source bytes of tensors being quantized that a device load through the ring holds in
#: scratch at once (see :meth:`LoadWork.windows`): each window is a ring run of its own, so
#: fewer, larger windows cost fewer drains of the ring
STAGING_BYTES = 2 << 30

#: tensors whose device statistics share one block of partial-result rows (80 bytes per row,
#: a row per block of the launch): allocated, and brought to the host, per block
STATS_BLOCK = 64

def plan(header, rows: list[int], sink, *, stats: bool, quantize: Any, path: str | None = None,
         launch=None) -> LoadWork | None:
    """The work a load of ``rows`` into ``sink`` does besides landing bytes, or None.

    ``quantize`` is None, ``"int8"`` or an :class:`~engine.quantize.Int8`; a selected tensor
    without the spec's axis raises :class:`~engine.errors.SerializationError` here, before
    anything is read.  Device statistics are planned for device sinks only, and only where
    the device kernels work (:mod:`engine.loading.kernel_probe`): elsewhere a torch or CuPy
    sink does the work with its framework's operations on the device, and other sinks keep
    statistics with the CPU fold of the file's bytes and quantize on the CPU; either way
    with one :class:`~engine.errors.DeviceFallbackWarning` per process, and the same results.
    """
    device_stats = bool(stats) and sink.on_device
    if quantize is None and not device_stats:
        return None  # nothing to do: and Numba is not imported
    from engine.numerics.quantize import Int8

    spec = Int8.of(quantize)
    on_cpu = False
    fallback = None
    if sink.on_device:
        why = device_kernels_unusable(gpu_of(sink))
        if why is not None:
            from engine.numerics._device_fallback import ops_for

            fallback = ops_for(getattr(sink, "name", ""))
            warn_fallback(why, None if fallback is None else fallback.name)
            if fallback is None:
                device_stats, on_cpu = False, True
                if spec is None:
                    return None  # statistics alone: the CPU fold of the file's bytes
    return LoadWork(header, rows, sink, spec, device_stats, path, launch, quantize_on_cpu=on_cpu,
                    fallback=fallback)


def gpu_of(sink) -> int | None:
    """The CUDA device index of a device sink (resolved when the sink was made), or None."""
    dev = getattr(sink, "device", None)
    return getattr(sink, "device_id", None) if dev is None else getattr(dev, "index", None)


def _host_round_trip(sink) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """``(to_host, to_device)`` of the sink's framework: a device tensor as a CPU tensor or
    array, and a CPU array back as a device tensor of the sink's device."""
    if getattr(sink, "name", None) == "torch":
        import torch

        device = sink.device
        return (lambda x: x.cpu()), (lambda a: torch.as_tensor(a).to(device))
    if getattr(sink, "name", None) == "cupy":
        import cupy

        def to_device(a):
            with cupy.cuda.Device(sink.device_id):
                return cupy.asarray(a)

        return cupy.asnumpy, to_device
    # another device framework (or a test double) brings its own
    return sink.to_host, sink.from_host


def _allocator(sink) -> Callable[[tuple, Any], Any]:
    """``empty(shape, numpy dtype)`` in the sink's framework and device."""
    if getattr(sink, "name", None) == "torch":
        import torch

        device = sink.device
        return lambda shape, dt: torch.empty(shape, dtype=getattr(torch, np.dtype(dt).name), device=device)
    if getattr(sink, "name", None) == "cupy":
        import cupy

        def empty(shape, dt):
            with cupy.cuda.Device(sink.device_id):
                return cupy.empty(shape, np.dtype(dt))

        return empty
    return sink.empty_device  # another device framework (or a test double) brings its own


def _in_context(empty, context):
    """``empty`` called inside ``context()`` (:meth:`LoadWork._on_device`)."""

    def pushed(shape, dt):
        with context():
            return empty(shape, dt)

    return pushed


def _widen(spans: dict[int, list], of, lo: int, hi: int) -> None:
    """``spans[id(of)]`` (``[of, lo, hi]``) widened to cover ``lo:hi``."""
    span = spans.setdefault(id(of), [of, lo, hi])
    span[1], span[2] = min(span[1], lo), max(span[2], hi)


class LoadWork:
    """Statistics and quantization attached to one load (see the module docstring).

    Built by :func:`plan`; the loader calls :meth:`destination`, passes :meth:`landed` to
    the pipeline, and hands out :meth:`tensor` and :meth:`stats`.
    """

    def __init__(self, header, rows, sink, spec, device_stats: bool, path, launch, *,
                 quantize_on_cpu: bool = False, fallback=None) -> None:
        t = header.table
        self.sink = sink
        self.path = path
        self.spec = spec
        self.on_device = bool(sink.on_device)
        # quantize selected tensors on the device where they land (staging buffers, kernels),
        # or on the CPU: CPU loads, and device loads where the kernels cannot run
        self._quantize_here = self.on_device and not quantize_on_cpu
        self._round_trip = _host_round_trip(sink) if self.on_device and quantize_on_cpu else None
        # the framework's own operations on the device instead of the kernels (plan())
        self._fallback = fallback
        self._fallback_stats: dict[int, list] = {}  # row -> partial statistics on the device
        self._launch = launch
        self._names = t.names
        self._quant: dict[int, tuple[str, tuple, int | None]] = {}
        if spec is not None:
            for r in rows:
                kind = _dt.NAMES[int(t.codes[r])]
                chosen, axis = spec.select(t.names[r], kind, tuple(t.shapes[r]), path)
                if chosen:
                    self._quant[r] = (kind, tuple(t.shapes[r]), axis)
        self._stats_kind: dict[int, str] = {}
        if device_stats:
            if fallback is not None:  # the kernels' module needs numba.cuda: the fallback does not
                from engine.numerics._device_fallback import SUPPORTED_NAMES
            else:
                from engine.numerics.device import SUPPORTED_NAMES

            for r in rows:
                kind = _dt.NAMES[int(t.codes[r])]
                if kind in SUPPORTED_NAMES:
                    self._stats_kind[r] = kind
        self._done: dict[int, Any] = {}  # row -> QuantizedTensor
        self._targets: Staging | None = None
        self._device_ops: Any = None  # the load's DeviceOps (destination()): its fence is recorded per window
        self._runtime: Any = None  # the CUDA runtime its device operations name (_on_device)
        self._empty = _allocator(sink) if self.on_device else None
        self._gpu = gpu_of(sink)  # "cuda" without an index was resolved by the sink, on the caller's thread
        self._streams = threading.local()
        # kernels launched per landed tensor, gathered later
        self.staging_bytes = STAGING_BYTES
        self._lock = threading.Lock()
        self._gathering = threading.Lock()  # one gather at a time: a row is found once it returns
        self._side: Any = None  # the load's side stream (ring)
        self._pending: list[tuple] = []  # (row, accumulator, q, scale, bad, scratch) launched, not gathered
        self._counters: dict[int, tuple] = {}  # row -> (counts, keys, their block, offset): zeroed per window
        self._accumulators: dict[str, Any] = {}  # format -> the AccumulatorBlock being filled
        self._orphans: list = []  # memory of tensors whose launches failed part way (close() waits)
        self._stats_done: dict[int, Any] = {}  # row -> Stats gathered
        self.launched = 0  # tensors whose kernels were launched as they landed (ring)

    # ---------------------------------------------------------------- what the loader asks

    def host_stats_rows(self, rows: list[int]) -> list[int]:
        """The rows whose statistics the CPU fold still computes (those not on the device)."""
        return [r for r in rows if r not in self._stats_kind]

    def destination(self, header, rows: list[int], per_tensor: bool):
        """(row -> tensor, pipeline.Destination) for a device load: the tensors to quantize
        get no destination tensor, only a scratch buffer of their source bytes, made when
        the ring run (window) holding them is planned."""
        t = header.table
        staged = self._quant if self._quantize_here else {}
        plain = [(r, int(t.codes[r]), t.shapes[r], int(t.ends[r]) - int(t.begins[r])) for r in rows
                 if r not in staged]
        tensors, targets, ops = self.sink.allocate_device(plain, per_tensor)
        self._device_ops = ops
        if self._empty is not None:
            self._empty = _in_context(self._empty, self._on_device)
        sizes = {r: int(t.ends[r]) - int(t.begins[r]) for r in staged}
        self._targets = Staging(targets, sizes, self._empty)
        hooked = bool(self._stats_kind) or bool(sizes)
        return tensors, pipeline.Destination(device_targets=self._targets, device_ops=ops,
                                             windows=self.windows if sizes else None, hooked=hooked)

    def windows(self, requests):
        """Consecutive runs of ``requests`` (one file's, in file order) for ring runs of their
        own: a run closes before a request that starts a tensor to quantize once the run's
        tensors to quantize would pass :attr:`staging_bytes` of source bytes.  A tensor may
        straddle two runs (its scratch buffer is the same in both; it lands in the second).
        Between runs the launched kernels are waited for and their scratch freed
        (:meth:`gather`).

        Scratch on the device at once: the run's own tensors, at most ``staging_bytes`` or
        else those starting in its first read request, plus the one straddling from the run
        before; in all at most ``staging_bytes`` plus twice the largest tensor to quantize
        (or plus one read request's bytes and the largest tensor, where that is more), plus
        under :data:`~engine.loading._staging.ALIGN` bytes of padding per tensor (their offsets in
        the run's block); the cut itself is :func:`~engine.loading._staging.cut_windows`.
        """
        sizes = self._targets.sizes if self._targets is not None else {}
        for window, fresh in cut_windows(requests, sizes, self.staging_bytes):
            self._stage(fresh)
            yield window
            self.gather()
            self._fence_again()

    def _fence_again(self) -> None:
        """After a window's work is queued: the consumer's fence recorded again on this
        thread's current stream, so that the next window's copies wait for it.  The fallback's
        operations still read the window's scratch there when it is freed, and a caching
        allocator hands its block to the next window's staging at once (its reuse is ordered
        on that stream only, not on the ring's)."""
        again = getattr(self._device_ops, "fence_again", None)
        if again is not None:
            with self._on_device():  # a framework's device guard on this thread: see _on_device
                again()
            with self._lock:
                self._fence_side()  # the next window's kernels follow it too

    def _stage(self, rows: list[int]) -> None:
        """Before a window's ring run: one scratch allocation for its tensors to quantize,
        and (the kernels' path) one zeroed allocation for their NaN/Inf counts and channel
        maxima, so that a tensor's launches allocate and zero nothing of their own."""
        self._targets.stage(rows)  # type: ignore[union-attr]  # set by destination()
        if self._fallback is not None or not rows:
            return
        from engine.numerics.device import as_device_array, on_gpu, zero

        channels = [max(self._channels(r), 1) for r in rows]
        # int64 cells: every tensor's 3 counts first (brought to the host together, a few bytes
        # a tensor), then each one's C uint32 keys
        keys_at = 3 * len(rows)
        with self._failing_as_device_error(rows, "setting up the device kernels of", batch=True), on_gpu(self._gpu):
            block = self._empty((keys_at + sum(-(-c // 2) for c in channels),), np.int64)  # type: ignore[misc]  # device loads only
            flat = as_device_array(block)
            zero(flat, self._side_stream())
        for i, (r, c) in enumerate(zip(rows, channels, strict=True)):
            n = -(-c // 2)
            self._counters[r] = (flat[3 * i : 3 * i + 3], flat[keys_at : keys_at + n].view(np.uint32)[:c], flat, 3 * i)
            keys_at += n

    def _channels(self, row: int) -> int:
        _, shape, axis = self._quant[row]
        return 1 if axis is None else shape[axis]

    def landed(self, row: int) -> None:
        """Completion hook (every copy of ``row`` has completed): launch its statistics and
        quantization kernels (:meth:`gather` collects them), or the framework's operations of
        the fallback.  A failure of the kernels raises :class:`~engine.errors.DeviceError`
        naming the tensor."""
        with self._failing_as_device_error([row]), self._on_device():  # a launch refused, a kernel that failed to compile
            if self._fallback is not None:
                self._landed_fallback(row)
            else:
                self._landed_ring(row)

    @contextlib.contextmanager
    def _on_device(self):
        """The load's device's primary context pushed on this thread for the block, and popped
        after (:func:`engine.gpu.cudart.on_device`): a framework's device guard entered on one of
        the engine's threads (CuPy's ``Device``) then finds that device current, and does not
        set device 0, whose context it would make, on its way out.  Nothing where the device
        operations name no runtime."""
        ops = self._device_ops
        if self._runtime is None and ops is not None:  # looked up once per load
            path = ops.runtime_path() if hasattr(ops, "runtime_path") else None
            if path:
                from engine.gpu.cudart import runtime

                self._runtime = runtime(path)
        if self._runtime is None:
            yield
            return
        from engine.gpu.cudart import on_device

        with on_device(self._runtime, ops.device_index):
            yield

    @contextlib.contextmanager
    def _failing_as_device_error(self, rows: list[int], what: str = "the device kernels of", batch: bool = False):
        """Whatever the device work of ``rows`` raises (a launch the runtime refused, a kernel
        that failed, an allocation) as :class:`~engine.errors.DeviceError` naming them (the
        message names one tensor, or counts a batch's)."""
        try:
            yield
        except SafetensorError:
            raise
        except Exception as exc:
            names = tuple(self._names[r] for r in rows)
            who = f"tensor {names[0]!r}" if not batch else f"{len(names)} tensor(s)"
            raise DeviceError(f"{what} {who} failed: {type(exc).__name__}: {exc}", path=self.path,
                              tensors=names) from exc

    def tensor(self, row: int, tensor: Any) -> Any:
        """What the load hands out for ``row``: its tensor, or its QuantizedTensor."""
        if row not in self._quant:
            return tensor
        if self._fallback is not None or self._quantize_here:
            if self._fallback is None and row not in self._done:
                self.gather()
            with self._failing_as_device_error([row]):  # a tensor without bytes is quantized here
                return self._quantized_fallback(row) if self._fallback is not None else self._quantized_ring(row)
        from engine.numerics.quantize import QuantizedTensor, quantize_int8

        kind, _, axis = self._quant[row]
        name = self._names[row]
        source = tensor if self._round_trip is None else self._round_trip[0](tensor)
        try:
            q, scale = quantize_int8(source, axis, on_nonfinite=self.spec.on_nonfinite, name=name)
        except NonFiniteError as err:
            err.path = self.path
            raise
        if self._round_trip is not None:  # the device's own copies; the full-precision tensor goes
            q, scale = self._round_trip[1](q), self._round_trip[1](scale)
        return QuantizedTensor(q, scale, axis, kind)

    def stats(self, row: int):
        """Device statistics of a complete tensor (asked once: its accumulators go), or
        None when the CPU fold summarises it (or nothing does)."""
        if row not in self._stats_kind:
            return None
        if self._fallback is not None:
            from engine.numerics import _device_fallback

            parts = self._fallback_stats.pop(row, None)
            if parts is None:  # a tensor without bytes never lands
                parts = _device_fallback.stats_parts(self._fallback, self._targets[row], self._stats_kind[row])  # type: ignore[index]  # set by destination()
            return _device_fallback.stats_result(self._fallback, self._stats_kind[row], parts)
        from engine.numerics.statistics import Stats

        if row not in self._stats_done:
            self.gather()
        got = self._stats_done.pop(row, None)
        return Stats.empty() if got is None else got  # a tensor without bytes never lands

    def has_device_stats(self, row: int) -> bool:
        return row in self._stats_kind

    # ---------------------------------------------------------------- device work, through the ring

    def _side_stream(self):
        """The load's one stream for the kernels launched as tensors land (their bytes are
        complete when reported: no ordering with the ring's stream is needed).  It waits for
        the consumer's fence first: the kernels write memory the framework's allocator handed
        out on the consumer's stream, which work queued there may still use."""
        with self._lock:  # one stream, whichever thread (issuing, handing out) asks first
            if self._side is None:
                from engine.numerics.device import SIMULATOR

                if SIMULATOR:
                    self._side = 0
                else:
                    from numba import cuda

                    self._side = cuda.stream()
                    self._fence_side()
            return self._side

    def _fence_side(self) -> None:
        """Work queued on the side stream from now on waits for the consumer's fence (its
        last record: :meth:`_fence_again` records it again per window).  Nothing to do under
        the simulator, or without a fence."""
        from engine.gpu.device_ring import consumer_fence

        ops, side = self._device_ops, self._side
        fence = consumer_fence(ops) if ops is not None else None
        if fence is None or side is None or side == 0:
            return
        handle = getattr(side, "handle", side)  # a Numba stream's CUstream (ctypes, or the bindings' object)
        handle = int(getattr(handle, "value", handle) or 0)
        with self._on_device():
            if self._runtime is not None:  # None: the operations name no runtime to call
                self._runtime.wait_event(handle, fence)

    def _landed_ring(self, row: int) -> None:
        stats = row in self._stats_kind
        quant = row in self._quant and self._quantize_here
        if not stats and not quant:
            return
        from engine.numerics.device import AccumulatorBlock, DeviceQuantizer, as_device_array, on_gpu

        src = self._targets.pop(row, None) if quant else self._targets[row]  # type: ignore[union-attr,index]  # set by destination()
        held: list = [src]  # the device memory this tensor's launches use
        try:
            with on_gpu(self._gpu):
                stream = self._side_stream()
                acc = q = scale = bad = None
                if stats and src is not None:
                    kind = self._stats_kind[row]
                    block = self._accumulators.get(kind)
                    if block is None or block.full():  # a block per format: its rows set up by one launch
                        block = self._accumulators[kind] = AccumulatorBlock(
                            STATS_BLOCK, kind, self._launch_config(), self._empty, stream)
                    held.append(block)
                    rows, index = block.take()
                    rows.add(as_device_array(src), stream)
                    acc = (block, index)
                if quant:
                    kind, shape, axis = self._quant[row]
                    q = self._empty(shape, np.int8)  # type: ignore[misc]  # device loads only
                    scale = self._empty((1 if axis is None else shape[axis],), np.float32)  # type: ignore[misc]
                    counts, keys, flat, at = self._counters.pop(row, (None, None, None, 0))
                    held += [q, scale, flat]
                    got = DeviceQuantizer(self._launch_config(), self._empty).launch_quantize(
                        src, kind, shape, axis, q, scale, stream, counts=counts, keys=keys)
                    # the counts as (array, offset): a window's block is copied once per gather
                    bad = (got, 0) if flat is None else (flat, at)
        except BaseException:
            # launches queued before the one that failed may still use this memory: it is kept
            # until close() has waited for the side stream
            with self._lock:
                self._orphans.append(held)
            raise
        self.launched += 1
        with self._lock:
            # the scratch stays referenced until its kernels are waited for (a framework's
            # allocator could hand its memory out again while they run)
            self._pending.append((row, acc, q, scale, bad, held))

    def gather(self) -> None:
        """Bring the results of every tensor launched so far to the host, with one wait on
        the side stream for all of them, and free their scratch buffers."""
        with self._gathering:
            with self._lock:
                pending, self._pending = self._pending, []
            if pending:
                with self._failing_as_device_error([p[0] for p in pending], batch=True):  # a kernel's failure shows at the wait
                    self._gather(pending)

    def _gather(self, pending: list) -> None:
        """One copy to the host per block of partial rows and per block of counts (the span
        of them these tensors use), then one wait."""
        from engine.numerics.device import on_gpu, synchronize, to_host

        spans: dict[int, list] = {}  # id(block) -> [block, lo, hi] of the rows to bring over
        counts: dict[int, list] = {}  # id(array) -> [array, lo, hi] of the counts to bring over
        for _, acc, _, _, bad, _ in pending:
            if acc is not None:
                _widen(spans, acc[0], acc[1], acc[1] + 1)
            if bad is not None:
                _widen(counts, bad[0], bad[1], bad[1] + 3)
        with on_gpu(self._gpu):
            stream = self._side_stream()
            try:
                rows = {k: block.queue_rows(lo, hi, stream) for k, (block, lo, hi) in spans.items()}
                host = {k: to_host(a[lo:hi], stream) for k, (a, lo, hi) in counts.items()}
            finally:  # whatever was queued on these tensors' memory is done before it may go
                synchronize(stream)
        for row, acc, q, scale, bad, _ in pending:
            if acc is not None:
                block, index = acc
                self._stats_done[row] = block.merge_rows(index, spans[id(block)][1], rows[id(block)])
            if q is not None:
                a, at = bad
                lo = counts[id(a)][1]
                self._done[row] = (q, scale, np.asarray(host[id(a)][at - lo : at - lo + 3], np.int64).copy())

    def _quantized_ring(self, row: int):
        done = self._done.pop(row, None)
        if done is None:  # a tensor without bytes never lands
            from engine.numerics.device import on_gpu

            with on_gpu(self._gpu):
                return self._quantize_device(row, None)
        return self._quantized(row, *done)

    def _quantized(self, row: int, q, scale, bad):
        """The QuantizedTensor of ``row`` once its NaN/Inf counts (``bad``, on the host) pass."""
        from engine.numerics.quantize import QuantizedTensor, raise_if_nonfinite

        kind, _, axis = self._quant[row]
        if self.spec.on_nonfinite == "raise":
            try:
                raise_if_nonfinite(bad, self._names[row])
            except NonFiniteError as err:
                err.path = self.path
                raise
        return QuantizedTensor(q, scale.reshape(()) if axis is None else scale, axis, kind)

    def close(self) -> None:
        """The load ends (or failed): wait for kernels still queued, so that no scratch
        buffer or output is freed under them."""
        if self._fallback is None:
            try:
                self.gather()
            except Exception:  # noqa: S110 - the load's own error, if any, is what the caller sees
                pass
            if self._side is not None:  # launches no gather waits for: a window's zeroing, a tensor's
                from engine.numerics.device import on_gpu, synchronize  # launches before one failed

                try:
                    with on_gpu(self._gpu):
                        synchronize(self._side)
                except Exception:  # noqa: S110 - as above
                    pass
            self._orphans.clear()

    # ---------------------------------------------------------------- device work

    def _launch_config(self):
        if self._launch is None:
            from engine.numerics.device import DEFAULT_LAUNCH

            self._launch = DEFAULT_LAUNCH
        return self._launch

    def _stream(self):
        """A stream of this thread's own for the quantization kernels (the data is
        complete: no ordering with the copies' streams is needed)."""
        s = getattr(self._streams, "s", None)
        if s is None:
            from engine.numerics.device import SIMULATOR

            if SIMULATOR:
                s = 0
            else:
                from numba import cuda

                s = cuda.stream()
            self._streams.s = s
        return s

    def _landed_fallback(self, row: int) -> None:
        """:meth:`landed` with the framework's operations: the statistics of a float tensor
        and its quantization are queued on the device (nothing waits for them here)."""
        from engine.numerics import _device_fallback

        ops = self._fallback
        quantized = row in self._quant
        src = self._targets.pop(row, None) if quantized else self._targets[row]  # type: ignore[union-attr,index]  # set by destination()
        if row in self._stats_kind and src is not None:
            self._fallback_stats[row] = _device_fallback.stats_parts(ops, src, self._stats_kind[row])
        if quantized:
            self._done[row] = self._quantize_fallback(row, src)
            if src is not None:
                ops.release(src)  # the staging buffer goes now; the queued work must keep its memory

    def _quantize_fallback(self, row: int, src):
        from engine.numerics import _device_fallback

        kind, shape, axis = self._quant[row]
        q = self._empty(shape, np.int8)  # type: ignore[misc]  # device loads only
        scale = self._empty((1 if axis is None else shape[axis],), np.float32)  # type: ignore[misc]  # device loads only
        bad = _device_fallback.quantize(self._fallback, src, kind, shape, axis, q, scale)
        return q, scale, bad

    def _quantized_fallback(self, row: int):
        """The QuantizedTensor of ``row`` from :meth:`_landed_fallback`'s work (waits for its
        NaN/Inf counts: three numbers)."""
        done = self._done.pop(row, None)
        if done is None:  # a tensor without bytes never lands
            done = self._quantize_fallback(row, None)
        q, scale, bad = done
        return self._quantized(row, q, scale, self._fallback.host(bad))  # type: ignore[union-attr]  # fallback set

    def _quantize_device(self, row: int, src):
        from engine.numerics.device import DeviceQuantizer

        kind, shape, axis = self._quant[row]
        C = 1 if axis is None else shape[axis]
        q = self._empty(shape, np.int8)  # type: ignore[misc]  # device loads only
        scale = self._empty((C,), np.float32)  # type: ignore[misc]  # device loads only
        if math.prod(shape) and src is None:  # pragma: no cover - a tensor with bytes always lands
            raise RuntimeError(f"tensor {self._names[row]!r} was never staged")
        bad = DeviceQuantizer(self._launch_config(), self._empty).quantize(src, kind, shape, axis, q, scale,
                                                                          self._stream())
        return self._quantized(row, q, scale, bad)
