"""Tensor-parallel loading, direct mode: every read of a rank planned up front from the
headers (a block of rows is one contiguous range, a block of columns a set of strided runs,
read one by one or as dense spans through a bounce buffer), then shared among one set of
reader threads, or copied out of a read-only mapping.

Importing this module imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from engine.apps.opener import is_checkpoint_path
from engine.base._threads import run_threads
from engine.errors import ShardingError
from engine.parallel.tp_slices import open_torch, shard_of
from engine.planning.sharding_plan import Replicate, ShardingPlan, shard_index, shard_shape

__all__ = [
    "DirectFile", "direct_files", "direct_jobs", "Job", "MappedView", "copy_mapped", "direct_read_bytes", "load_files_direct",
    "STRIDED", "POPULATE_MAX_GAP", "SPAN_BOUNCE_BYTES", "SPAN_MAX_RUN_BYTES", "SPAN_MAX_RATIO",
]


class DirectFile(NamedTuple):
    """One file of a direct load, the ``names`` filter for it, and its header where the
    checkpoint's index check has read it already."""

    path: str
    names: Callable[[str], bool] | None
    header: Any = None


def direct_files(path_or_index, names: Callable[[str], bool] | None) -> list[DirectFile]:
    """The files a direct load reads: the file itself, or each shard file of a checkpoint
    keeping the tensors the index puts in it (index checked against the shards' headers,
    which come along so that no header is parsed twice)."""
    path = os.fspath(path_or_index)
    if not is_checkpoint_path(path):
        return [DirectFile(path, names)]
    from engine.checkpoints.checkpoint import read_checkpoint_info

    info = read_checkpoint_info(path)
    return [DirectFile(info.shard_path(shard), _in_shard(info.weight_map, shard, names), info.headers[shard])
            for shard in info.shards]


def _in_shard(weight_map: Mapping[str, str], shard: str, names: Callable[[str], bool] | None) -> Callable[[str], bool]:
    """A ``names`` filter for one shard file: the tensors the index puts in it (and ``names``)."""
    return lambda name: weight_map.get(name) == shard and (names is None or names(name))


STRIDED = ("auto", "runs", "spans")
#: A mapped copy maps its whole span in one call when the gaps between its runs average at
#: most this (a fault's read-ahead window); else the runs fault their own pages in.
POPULATE_MAX_GAP = 128 << 10
#: Bounce buffer per reader thread for column blocks read as dense spans: fits in a core's
#: L2 cache next to the rows being copied out of it.
SPAN_BOUNCE_BYTES = 1 << 20
#: "auto" reads a column block as spans only when its runs are shorter than this...
SPAN_MAX_RUN_BYTES = 16 << 10
#: ...and the spans hold at most this many times the bytes the rank wants.
SPAN_MAX_RATIO = 8
#: Contiguous reads are cut into requests of this size, shared among the threads.
_CHUNK_BYTES = 8 << 20


class Job(NamedTuple):
    """One read of a rank's direct load: runs ``src`` of ``run_bytes`` at file offset ``base``
    into ``dst`` (bytes), end to end; ``spans`` reads them through the bounce buffer."""

    dst: memoryview
    src: Any  # numpy int64 offsets, relative to ``base``
    run_bytes: int
    base: int
    spans: bool


class MappedView(NamedTuple):
    """A shard that is one contiguous range of the file, handed out as a view of the mapping."""

    code: int
    shape: tuple
    offset: int  # absolute, in the file
    nbytes: int


def direct_jobs(header, plan: ShardingPlan, rank: int, world_size: int, names, strided: str,
                 views: bool = False):
    """(name -> output tensor or, with ``views``, a :class:`MappedView` for each shard that
    is one contiguous range of the file; jobs; names to load the slow way) for a direct load
    of one file."""
    import numpy as np

    from engine.base import dtypes
    from engine.planning.plan import plan_slice

    t = header.table
    outputs: dict[str, Any] = {}  # tensors, and MappedView where views are asked for
    jobs: list[Job] = []
    slow: list[str] = []
    codes, begins = t.codes.tolist(), t.begins.tolist()  # not a numpy scalar per tensor
    for row in t.file_order():
        name = t.names[row]
        if names is not None and not names(name):
            continue
        code = codes[row]
        d = dtypes.DTYPES[code]
        shape = tuple(t.shapes[row])
        action = plan.action(name)
        pieces = shard_index(name, shape, action, rank, world_size)
        begin = header.data_start + begins[row]
        if isinstance(action, Replicate):
            if d.sub_byte:
                slow.append(name)
                continue
            out_shape = shape
        else:
            dim = action.dim % len(shape)
            # pieces that land end to end in the output: one piece, or several stacked along dim 0;
            # padding only after the last piece along dim 0
            if d.sub_byte or (dim != 0 and (len(pieces) > 1 or pieces[0][1] is not None)):
                slow.append(name)
                continue
            out_shape = shard_shape(shape, action, pieces)
        plans = [plan_slice(shape, d.itemsize, index) for index, _ in pieces]
        if views and len(pieces) == 1 and pieces[0][1] is None and plans[0].src.size <= 1:
            # one range of the file (or nothing): no bytes to move
            sp = plans[0]
            at = int(sp.src[0]) if sp.src.size else 0
            outputs[name] = MappedView(code, tuple(out_shape), begin + at, sp.nbytes)
            continue
        out = (torch.zeros if any(to is not None for _, to in pieces) else torch.empty)(
            out_shape, dtype=dtypes.torch_dtype(code))
        outputs[name] = out
        raw = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        at = 0
        for sp in plans:
            nbytes = sp.nbytes
            if not nbytes:
                continue
            dst = raw[at : at + nbytes]
            at += nbytes
            if sp.src.size == 1 or sp.run_bytes * 2 >= _CHUNK_BYTES:
                # contiguous, or long runs: requests of about _CHUNK_BYTES
                per = max(1, _CHUNK_BYTES // sp.run_bytes) if sp.src.size > 1 else 1
                if sp.src.size == 1:
                    for lo in range(0, nbytes, _CHUNK_BYTES):
                        hi = min(lo + _CHUNK_BYTES, nbytes)
                        jobs.append(Job(dst[lo:hi], np.array([sp.src[0] + lo], np.int64), hi - lo, begin, False))
                else:
                    for i in range(0, sp.src.size, per):
                        part = sp.src[i : i + per]
                        jobs.append(Job(dst[i * sp.run_bytes : (i + part.size) * sp.run_bytes], part,
                                         sp.run_bytes, begin, False))
                continue
            spans = strided == "spans" or (strided == "auto" and _spans_pay(sp.src, sp.run_bytes))
            # a share of rows per job, a few bounce buffers' worth, so threads split a tensor
            stride = int(sp.src[1] - sp.src[0]) if sp.src.size > 1 else sp.run_bytes
            per = max(1, (4 * SPAN_BOUNCE_BYTES) // max(stride, sp.run_bytes))
            for i in range(0, sp.src.size, per):
                part = sp.src[i : i + per]
                jobs.append(Job(dst[i * sp.run_bytes : (i + part.size) * sp.run_bytes], part, sp.run_bytes,
                                 begin, spans))
    return outputs, jobs, slow


def copy_mapped(source, job: Job) -> None:
    """Copy a job's runs out of the mapped file ``source`` (uint8) into ``job.dst``: one
    strided copy when the runs are evenly spaced (a column block), else run by run.  numpy
    releases the GIL for the copy."""
    import numpy as np

    from engine.io.reader import populate_mapping

    dst = np.frombuffer(job.dst, np.uint8)
    n, run = job.src.size, job.run_bytes
    first = job.base + int(job.src[0])
    last = job.base + int(job.src[-1]) + run
    if n == 1 or (last - first) - n * run <= POPULATE_MAX_GAP * (n - 1):
        # the pages the copy touches, mapped in one call rather than one fault each (the
        # gaps between runs are short: the kernel's read-ahead would read them anyway)
        populate_mapping(source, first, last)
    if n == 1:
        dst[:] = source[first : first + run]
        return
    steps = np.diff(job.src)
    if (steps == steps[0]).all() and steps[0] >= run:
        rows = np.lib.stride_tricks.as_strided(source[first:], shape=(n, run), strides=(int(steps[0]), 1),
                                               writeable=False)
        dst.reshape(n, run)[...] = rows
        return
    for i, off in enumerate(job.src.tolist()):
        lo = job.base + off
        dst[i * run : (i + 1) * run] = source[lo : lo + run]


def _spans_pay(src, run_bytes: int) -> bool:
    """Whether "auto" reads these runs as dense spans: short runs, spans not much larger."""
    from engine.io.reader import spans_bytes

    if run_bytes >= SPAN_MAX_RUN_BYTES or src.size < 2:
        return False
    return spans_bytes(src, run_bytes, SPAN_BOUNCE_BYTES) <= SPAN_MAX_RATIO * run_bytes * src.size


def direct_read_bytes(path, plan: ShardingPlan, *, rank: int, world_size: int, strided: str = "auto",
                      names: Callable[[str], bool] | None = None) -> int:
    """Bytes of tensor data one rank's direct-mode load of a file or a sharded checkpoint
    reads (the headers aside): its shard exactly with ``strided="runs"``, more where column
    blocks are read as spans.  From the headers alone; reads no tensor byte."""
    from engine.format.header import read_header
    from engine.io.reader import spans_bytes

    if strided not in STRIDED:
        raise ShardingError(f"unknown strided {strided!r}; expected one of {STRIDED}", reason="InvalidMode")
    total = 0
    for file, keep, header in direct_files(path, names):
        _, jobs, slow = direct_jobs(header if header is not None else read_header(file), plan, rank, world_size, keep, strided)
        if slow:
            raise ShardingError(f"{len(slow)} tensor(s) are read the slow way; no byte count for them",
                                reason="InvalidMode", tensors=tuple(slow), path=file)
        total += sum(spans_bytes(j.src, j.run_bytes, SPAN_BOUNCE_BYTES) if j.spans else j.src.size * j.run_bytes
                     for j in jobs)
    return total


class _FileLoad:
    """One file of a direct load: its descriptor and header, this rank's outputs (views made
    here), its planned jobs and, for mapped copies, the mapping they read."""

    def __init__(self, file: DirectFile, plan: ShardingPlan, rank: int, world_size: int, strided: str,
                 mapped: bool, views: bool) -> None:
        from engine.base._files import open_regular
        from engine.format.header import read_header_fd

        path, names, header = file
        self.path = path
        self.fd = open_regular(path)  # a FIFO or device is refused, never waited on
        try:
            size = os.fstat(self.fd).st_size
            if header is None or header.file_size != size:
                # not read yet, or the file changed since: read the header of the file now open
                header = read_header_fd(self.fd, path=path, file_size=size)
            self.header = header
            self.outputs, self.jobs, self.slow = direct_jobs(self.header, plan, rank, world_size, names, strided,
                                                              views)
            wanted = {n: v for n, v in self.outputs.items() if isinstance(v, MappedView)}
            mm = None
            if wanted:
                from engine.sinks import map_file
                from engine.sinks.torch import TorchSink

                # a private (copy-on-write) mapping, as safe_open(..., framework="pt") makes: the
                # shards are writable, and writes never reach the file; the copies below read it too
                sink = TorchSink()
                mm = map_file(sink, self.fd)
                base = sink.map(mm)
                for n, v in wanted.items():
                    self.outputs[n] = sink.view(base, v.code, v.shape, v.offset, v.nbytes)
            self.source = None
            if mapped and self.jobs:
                import mmap

                import numpy as np

                if mm is None:
                    mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
                self.source = np.frombuffer(mm, np.uint8)
        except BaseException:
            os.close(self.fd)
            raise

    def run(self, job: Job, bounce: list) -> None:
        """Do one job; ``bounce`` holds the calling thread's span buffer once it has one."""
        from engine.io.reader import pread_into, pread_runs, pread_spans

        if self.source is not None:
            copy_mapped(self.source, job)
        elif job.src.size == 1:
            pread_into(self.fd, job.base + int(job.src[0]), [job.dst], path=self.path)
        elif job.spans:
            if not bounce:
                bounce.append(bytearray(SPAN_BOUNCE_BYTES))
            pread_spans(self.fd, job.dst, job.src, job.run_bytes, job.base, bounce[0], path=self.path)
        else:
            pread_runs(self.fd, job.dst, job.src, job.run_bytes, job.base, path=self.path)

    def finish(self, plan: ShardingPlan, rank: int, world_size: int) -> dict[str, torch.Tensor]:
        """The outputs, the tensors planned the slow way added, in file order."""
        if self.slow:
            with open_torch(self.path, "pread") as f:
                for name in self.slow:
                    self.outputs[name] = shard_of(f, name, plan.action(name), rank, world_size)
        order = {n: i for i, n in enumerate(self.header.offset_keys())}
        return dict(sorted(self.outputs.items(), key=lambda kv: order[kv[0]]))

    def close(self) -> None:
        os.close(self.fd)


def load_files_direct(files: list[DirectFile], plan: ShardingPlan, rank: int, world_size: int,
                       strided: str, threads: int | None, mapped: bool = False,
                       views: bool = False) -> dict[str, torch.Tensor]:
    """Direct mode on ``files``: every read of this rank in every
    file planned up front, then shared among one set of threads in file order (several reads
    in flight), column blocks by runs or spans, or (``mapped``) copied out of a read-only
    mapping; with ``views`` (and ``mapped``), shards that are one range of a file are views
    of a private mapping instead.  The outputs come file by file, in file order."""
    import threading

    from engine.io.reader import default_threads

    loads: list[_FileLoad] = []
    try:
        for file in files:
            loads.append(_FileLoad(file, plan, rank, world_size, strided, mapped, views))
        items = [(load, job) for load in loads for job in load.jobs]
        todo = iter(items)
        lock = threading.Lock()

        def work() -> None:
            bounce: list = []
            while True:
                with lock:
                    item = next(todo, None)
                if item is None:
                    return
                item[0].run(item[1], bounce)

        if items:
            run_threads([work] * min(threads or default_threads(), len(items)), name="engine-tp")
        out: dict[str, torch.Tensor] = {}
        for load in loads:
            out.update(load.finish(plan, rank, world_size))
        return out
    finally:
        for load in loads:
            load.close()
