"""The host side of loading, against this machine's own copy limit: shared by
``scripts/bench_host.py`` and the asv suite ``bench_host``.

* :func:`limit_copy`: the machine's limit, a native parallel ``memcpy`` (pthreads, C compiled
  here with the system's ``cc``, nothing of the engine's) from a warm read-only mapping of
  the file, every page mapped first (``MADV_POPULATE_READ``), into pre-faulted memory:
  the same bytes, the same thread count as the engine's rows;
* :class:`Floor`: what a load that holds no mapping pays at least, natively: the kernel's
  ``pread`` copy, or a fresh mapping built, copied from and torn down; with
  :func:`cache_state`, which puts a file in the page cache in large folios or page by page
  (the two states price a mapping very differently);
* :class:`BenchDevice`: a device for the engine's copy path (the native chunk ring,
  ``engine.gpu.device_ring``) on a host without one: the emulated CUDA runtime of the tests
  (``tests/emucudart``, the same entry points as ``libcudart``), whose streams run each
  "device copy" on a thread into a pre-faulted device buffer.  ``dma="memcpy"`` moves the
  bytes (a CPU copy stands in for the DMA engine: it costs this host a core and a read and
  a write of every byte, which a real DMA engine does not); ``dma="none"`` completes the
  copy without moving anything (the host side of the copy path alone: page cache ->
  page-locked chunk, with the ring, its events and ordering).
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import subprocess
import tempfile

import numpy as np

_LIMIT_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>
#include <stdint.h>
#include <unistd.h>
#include <sys/mman.h>
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
/* mode 0: memcpy from src (a populated mapping); 1: pread from fd at off;
   2: from src, a fresh mapping, each step populated (MADV_POPULATE_READ) then copied */
typedef struct { char *dst; const char *src; size_t n; int fd; long long off; int mode; int err; } job_t;
#define STEP (16u << 20)
static void *run(void *p) {
    job_t *j = p;
    size_t done = 0;
    if (j->mode == 0) { memcpy(j->dst, j->src, j->n); return 0; }
    while (done < j->n) {
        size_t c = j->n - done < STEP ? j->n - done : STEP;
        if (j->mode == 1) {
            ssize_t r = pread(j->fd, j->dst + done, c, j->off + done);
            if (r <= 0) { j->err = 1; return 0; }
            c = (size_t)r;
        } else {
            uintptr_t lo = (uintptr_t)(j->src + done) & ~(uintptr_t)4095;
            if (madvise((void *)lo, (uintptr_t)(j->src + done + c) - lo, MADV_POPULATE_READ)) { j->err = 1; return 0; }
            memcpy(j->dst + done, j->src + done, c);
        }
        done += c;
    }
    return 0;
}
static int split(int mode, char *dst, const char *src, int fd, long long off, size_t n, int threads) {
    pthread_t tid[256]; job_t jobs[256];
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    size_t share = (n / threads) & ~(size_t)4095;
    for (int i = 0; i < threads; i++) {
        size_t lo = share * i, hi = i == threads - 1 ? n : share * (i + 1);
        jobs[i] = (job_t){dst + lo, src ? src + lo : 0, hi - lo, fd, off + (long long)lo, mode, 0};
    }
    for (int i = 1; i < threads; i++)
        if (pthread_create(&tid[i], 0, run, &jobs[i])) return -1;
    run(&jobs[0]);
    for (int i = 1; i < threads; i++) pthread_join(tid[i], 0);
    for (int i = 0; i < threads; i++)
        if (jobs[i].err) return -2;
    return 0;
}
int limit_copy(char *dst, const char *src, size_t n, int threads) {
    return split(0, dst, src, -1, 0, n, threads);
}
/* what a loader that holds no mapping pays at least: the kernel's copy out of the page cache */
int floor_pread(char *dst, int fd, long long off, size_t n, int threads) {
    return split(1, dst, 0, fd, off, n, threads);
}
/* ... or a mapping made for the copy: map, populate and copy step by step, unmap */
int floor_mapped(char *dst, int fd, long long off, size_t n, int threads) {
    long long base = off & ~4095LL;
    size_t len = n + (size_t)(off - base);
    char *map = mmap(0, len, PROT_READ, MAP_SHARED, fd, base);
    if (map == MAP_FAILED) return -3;
    int rc = split(2, dst, map + (off - base), fd, off, n, threads);
    munmap(map, len);
    return rc;
}
"""

_lib = None


def _limit_lib():
    global _lib
    if _lib is None:
        folder = os.path.join(tempfile.gettempdir(), f"engine-bench-limit-{os.getuid()}")
        os.makedirs(folder, exist_ok=True)
        # named by the source's hash: an older build of different source is never reused
        tag = hashlib.sha1(_LIMIT_C.encode()).hexdigest()[:12]
        src = os.path.join(folder, f"limit-{tag}.c")
        so = os.path.join(folder, f"limit-{tag}.so")
        if not os.path.exists(so):
            with open(src, "w") as f:
                f.write(_LIMIT_C)
            subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-pthread", src, "-o", so + ".tmp"],
                           check=True)
            os.replace(so + ".tmp", so)
        lib = ctypes.CDLL(so)
        lib.limit_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.limit_copy.restype = ctypes.c_int
        for name in ("floor_pread", "floor_mapped"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def threads() -> int:
    """The thread count every row uses: every core this process may run on."""
    return max(1, len(os.sched_getaffinity(0)))


def prefaulted(nbytes: int, huge: bool = False) -> np.ndarray:
    """``nbytes`` of anonymous memory with every page touched (written) once.

    In 4 KiB pages (unless the system puts every mapping in huge pages), as torch allocates a
    CPU tensor's memory, so that a limit or a floor writes into the same kind of memory as
    ``load_into``'s tensors; ``huge`` asks for transparent huge pages (``MADV_HUGEPAGE``), as
    numpy does for its own large arrays: the copies into them run faster (fewer TLB misses),
    which no load into a model's tensors gets."""
    buf = mmap.mmap(-1, max(nbytes, 1))
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    out = np.frombuffer(buf, np.uint8)[:nbytes]
    out[::4096] = 1
    out[-1:] = 1
    return out


def data_range(path: str) -> tuple[int, int]:
    """(first byte, bytes) of the file's tensor data."""
    import engine

    h = engine.read_header(path)
    return h.data_start, h.data_size


def twin(path: str, tag: str) -> str:
    """A byte-for-byte copy of the file ``path`` beside it (``-{tag}`` added to its name),
    made once: the same data in a second place in the page cache."""
    out = path[: -len(".safetensors")] + f"-{tag}.safetensors"
    if not os.path.exists(out):
        import shutil

        shutil.copyfile(path, out + ".tmp")
        os.replace(out + ".tmp", out)
    return out


def aligned_copy(path: str, align: int = 64) -> str:
    """A copy of the checkpoint ``path`` whose data region starts on an ``align``-byte
    boundary (its header padded with spaces, as the format allows; every reader, the
    reference's included, reads it unchanged), made once beside it.

    The kernel copies out of the page cache at memory speed when a read's file offset and
    its destination sit alike in a 64-byte line, and at two thirds of that or less when they
    do not: the data of a file written by the reference starts a multiple of 8 bytes into a
    line, and a tensor's memory starts on a line, so most files are read the slower way."""
    out = path[: -len(".safetensors")] + f"-aligned{align}.safetensors"
    if os.path.exists(out):
        return out
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = f.read(n)
        header += b" " * (-(8 + n) % align)
        with open(out + ".tmp", "wb") as g:
            g.write(struct.pack("<Q", len(header)) + header)
            while chunk := f.read(64 << 20):
                g.write(chunk)
    os.replace(out + ".tmp", out)
    return out


class Limit:
    """The limit copy of ``path``'s tensor data, set up once: ``run()`` copies it again
    (into 4 KiB pages, as a tensor's memory is, unless ``huge``: see :func:`prefaulted`)."""

    def __init__(self, path: str, nthreads: int | None = None, huge: bool = False) -> None:
        self.start, self.nbytes = data_range(path)
        self.threads = nthreads or threads()
        self.fd = os.open(path, os.O_RDONLY)
        self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        self.map.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))  # every page mapped first
        self.src = np.frombuffer(self.map, np.uint8)
        self.dst = prefaulted(self.nbytes, huge=huge)
        self.lib = _limit_lib()

    def run(self) -> None:
        src = self.src.ctypes.data + self.start
        if self.lib.limit_copy(self.dst.ctypes.data, src, self.nbytes, self.threads) != 0:
            raise OSError("limit copy: cannot start its threads")

    def check(self) -> bool:
        return bool((self.dst[:: 1 << 20] == self.src[self.start : self.start + self.nbytes : 1 << 20]).all())

    def close(self) -> None:
        del self.src
        self.map.close()
        os.close(self.fd)


class Floor:
    """What a load that holds no mapping of ``path`` pays at least (native, nothing of the
    engine's): ``kind="pread"``, every thread ``pread``s its share in 16 MiB requests;
    ``kind="mapped"``, a fresh read-only mapping, each thread populating
    (``MADV_POPULATE_READ``) and copying its share 16 MiB at a time, then the unmap.  The
    limit (:class:`Limit`) leaves out what a mapping costs to build and tear down; these
    rows price it: little for a file cached in large folios, a page table entry per 4 KiB
    page for a file cached page by page."""

    def __init__(self, path: str, kind: str, nthreads: int | None = None) -> None:
        self.start, self.nbytes = data_range(path)
        self.threads = nthreads or threads()
        self.fd = os.open(path, os.O_RDONLY)
        self.dst = prefaulted(self.nbytes)
        lib = _limit_lib()
        self.fn = {"pread": lib.floor_pread, "mapped": lib.floor_mapped}[kind]

    def run(self) -> None:
        rc = self.fn(self.dst.ctypes.data, self.fd, self.start, self.nbytes, self.threads)
        if rc != 0:
            raise OSError(f"floor copy failed ({rc})")

    def check(self, path: str) -> bool:
        with open(path, "rb") as f:
            f.seek(self.start)
            head = f.read(1 << 20)
        return bool(self.dst[: len(head)].tobytes() == head)

    def close(self) -> None:
        os.close(self.fd)


def cache_state(path: str, folios: str, evict: bool = True) -> int | None:
    """Put ``path`` in the page cache in a known state: ``folios="large"`` read with large
    sequential reads (the kernel reads ahead into large folios, as after a download or a
    loader's own large reads), ``"small"`` read with random-access advice (one 4 KiB page
    per folio, as after a reader that faulted a mapping in page by page).  With ``evict``
    it is dropped from the cache first; without, only the pages not resident are read in
    that way (a warm-up that keeps the state).  Returns what the reads added to the page
    cache's large folios (:func:`file_huge_kib`), KiB, or None where that is not known."""
    from . import common

    if evict:
        common.evict_cache(path)
    before = file_huge_kib()
    fd = os.open(path, os.O_RDONLY)
    try:
        if folios == "small":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            step = 1 << 20
        else:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            step = 64 << 20
        buf = bytearray(step)
        off = 0
        while n := os.preadv(fd, [buf], off):
            off += n
    finally:
        os.close(fd)
    after = file_huge_kib()
    return None if before is None or after is None else after - before


def file_huge_kib() -> int | None:
    """The page cache's bytes in large (PMD-sized) folios, KiB (``FileHugePages``), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("FileHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _emulator():
    """The tests' emulated CUDA runtime (built with ``cc`` on first use)."""
    import sys

    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from emucudart import Emulator

    return Emulator()


_STREAM: list = []  # one emulated stream for the process: a ring kept between loads uses it


class BenchDevice:
    """Ring operations over the emulated runtime (see the module docstring)."""

    device_index = 0

    def __init__(self, dma: str = "memcpy") -> None:
        if dma not in ("memcpy", "none"):
            raise ValueError(dma)
        self.emulator = _emulator()
        self.emulator.noop(dma == "none")
        if not _STREAM:
            _STREAM.append(self.emulator.new_stream())

    def runtime_path(self) -> str:
        return self.emulator.path

    def ring_stream(self):
        return _STREAM[0], None

    def address(self, target) -> int:
        return int(target.ctypes.data)

    def close(self) -> None:
        pass


class RingLoad:
    """The engine's device copy path (the chunk ring, default geometry) for every tensor of
    ``path`` into pre-faulted "device" buffers of a :class:`BenchDevice`; ``run()`` loads once.
    ``verify``: the file's per-tensor checksums checked as the copy threads fill each chunk."""

    def __init__(self, path: str, dma: str = "memcpy", slot_bytes: int | None = None, verify: bool = False) -> None:
        import engine
        from engine.format import checksums
        from engine.loading import pipeline
        from engine.planning.plan import plan_reads

        self.pipeline = pipeline
        h = engine.read_header(path)
        t = h.table
        rows = list(t.file_order())
        self.requests = plan_reads(t.begins, t.ends, rows, h.data_start)
        self.nbytes = h.data_size
        block = prefaulted(self.nbytes)
        self.block = block
        self.targets = {r: block[int(t.begins[r]) : int(t.ends[r])] for r in rows if int(t.ends[r]) > int(t.begins[r])}
        self.fd = os.open(path, os.O_RDONLY)
        self.path = path
        self.dma = dma
        self.slot_bytes = slot_bytes
        self.checks = checksums.Checks.of(h, path) if verify else None

    def run(self) -> None:
        dev = BenchDevice(self.dma)
        try:
            self.pipeline.run_sources([self.pipeline.Source(self.fd, self.path, self.requests, checks=self.checks)],
                                      self.pipeline.Destination(device_targets=self.targets, device_ops=dev),
                                      threads=threads(), slot_bytes=self.slot_bytes, gpu_path="copy")
        finally:
            dev.close()

    def check(self, limit_src: np.ndarray, start: int) -> bool:
        n = self.nbytes
        return bool((self.block[:: 1 << 20] == limit_src[start : start + n : 1 << 20]).all())

    def close(self) -> None:
        os.close(self.fd)
