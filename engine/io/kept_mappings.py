"""Populated file mappings kept between loads, when asked for (:func:`keep_mappings`).

A split copy out of a file mapping (:mod:`engine.io.reader`) pays for building the mapping's
page tables (``MADV_POPULATE_READ``) and tearing them down again, on every load: a few
milliseconds per GB for a file the page cache holds in 2 MiB folios, a hundred and more for
one it holds page by page.  A process that loads the same files again (a server that
reloads its weights, swaps models in and out of a device, or fills a second copy of a model)
pays it once with kept mappings: each file's mapping stays populated between loads and the
next load copies straight out of it, at the speed of a copy from memory already mapped.
Which pieces are mapped is still decided as without keeping (``ENGINE_COPY_SOURCE=auto``: by
what mapping them costs): a file cached in large folios is mapped whole by its first load,
one cached page by page is read with ``pread`` as before (a copy out of 4 KiB page entries
is no faster than the kernel's, which reads the page cache through its own large ones), and
pages once mapped cost nothing to map again, so later loads take them from the mapping.

What keeping costs: a kept file's pages count in the process's resident memory (shared
file pages, ``RssFile``: the page cache's, not a second copy, and the kernel may still
reclaim them), and a kept mapping holds its file open, so the blocks of a file deleted or
replaced meanwhile are freed only when its mapping goes.  A load that maps a file anew (one
not kept, or changed) first drops the kept mappings of files deleted since (a model
replaced on disk by a new file is one such load), :data:`KeptMappings.MAX_FILES` bounds how many are kept (the
least recently used goes first), and ``keep_mappings(False)`` drops them all.  Off by
default.  Used by :func:`engine.io.reader.copy_mapping`.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict

__all__ = ["KeptMapping", "KeptMappings", "KEPT_MAPPINGS", "keep_mappings"]


class KeptMapping(mmap.mmap):
    """A read-only mapping of a whole file that :class:`KeptMappings` keeps: the split copies
    copy every piece out of it and leave its pages mapped (``SplitReader.copy(keep=True)``)."""

    stamp: tuple[int, int, int]  # (size, mtime_ns, ctime_ns) of the file it maps
    users: int  # loads copying out of it now
    stale: bool  # no longer kept: closed by the last user
    fd: int  # a descriptor of the mapped file, to see whether it has been deleted


def _identity(st: os.stat_result) -> tuple[tuple[int, int], tuple[int, int, int]]:
    return (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class KeptMappings:
    """The process's kept mappings, one per file (device and inode), each valid while the
    file's size and modification times are those it was mapped with.

    :meth:`take` gives a load the kept mapping of its file (mapping and keeping one if
    there is none), :meth:`give` takes it back at the end of the load.  A mapping that stops
    being kept while a load copies out of it (:meth:`release`, a newer version of its file,
    more than :data:`MAX_FILES`) is closed by the last load that gives it back."""

    #: files whose mappings are kept at most (each holds two descriptors)
    MAX_FILES = 256

    def __init__(self) -> None:
        self.on = os.environ.get("ENGINE_KEEP_MAPPINGS", "") == "1"
        self.lock = threading.Lock()
        self.kept: OrderedDict[tuple[int, int], KeptMapping] = OrderedDict()  # least recently used first

    def take(self, fd: int) -> KeptMapping | None:
        """The kept mapping of ``fd``'s file, in use until :meth:`give`; None when mappings
        are not kept or the file cannot be mapped (empty, or refused)."""
        if not self.on:
            return None
        st = os.fstat(fd)
        key, stamp = _identity(st)
        drop: list[KeptMapping] = []
        with self.lock:
            m = self.kept.get(key)
            if m is not None and m.stamp != stamp:  # the file changed since it was mapped
                drop.append(self._forget(key))
                m = None
            if m is not None:
                self.kept.move_to_end(key)
                m.users += 1
                return m
            drop.extend(self._forget(k) for k, old in list(self.kept.items()) if _deleted(old))
        self._close(drop)
        if not st.st_size:
            return None
        try:
            m = KeptMapping(fd, st.st_size, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        m.stamp, m.users, m.stale = stamp, 1, False
        m.fd = os.dup(fd)
        with self.lock:
            old = self.kept.pop(key, None)  # another load mapped it meanwhile: keep the newer
            if old is not None:
                drop.append(self._stale(old))
            self.kept[key] = m
            while len(self.kept) > self.MAX_FILES:
                drop.append(self._stale(self.kept.popitem(last=False)[1]))
        self._close(drop)
        return m

    def give(self, m: KeptMapping) -> None:
        """The end of a load's use of ``m`` (from :meth:`take`)."""
        with self.lock:
            m.users -= 1
            last = m.stale and m.users == 0
        if last:
            _close_mapping(m)

    def release(self) -> None:
        """Stop keeping every mapping (those in use close when their loads end)."""
        with self.lock:
            drop = [self._stale(m) for m in self.kept.values()]
            self.kept.clear()
        self._close(drop)

    def __len__(self) -> int:
        return len(self.kept)

    def _forget(self, key) -> KeptMapping:
        return self._stale(self.kept.pop(key))

    @staticmethod
    def _stale(m: KeptMapping) -> KeptMapping:
        m.stale = True
        return m

    @staticmethod
    def _close(drop: list[KeptMapping]) -> None:
        for m in drop:
            if m.users == 0:
                _close_mapping(m)


def _deleted(m: KeptMapping) -> bool:
    try:
        return os.fstat(m.fd).st_nlink == 0
    except OSError:
        return True


def _close_mapping(m: KeptMapping) -> None:
    try:
        os.close(m.fd)
    except OSError:
        pass
    try:
        m.close()
    except BufferError:
        pass  # a view still alive somewhere: the garbage collector unmaps it


#: the process's kept mappings (see :func:`keep_mappings`)
KEPT_MAPPINGS = KeptMappings()


def keep_mappings(on: bool = True) -> None:
    """Keep each loaded file's populated read-only mapping between loads (``True``), or drop
    the kept ones and stop keeping them (``False``).

    A process that loads the same files again (reloads weights, swaps a model back onto a
    device) saves, on every load after the first, building and tearing down the mapping's
    page tables: ``load_into``, owned loads (``backend="pread"``) and the device copy path
    then copy at the speed of a copy from memory already mapped.  The pieces a load maps are
    chosen as without keeping (``ENGINE_COPY_SOURCE``): a file
    the page cache holds in large folios is mapped, one it holds page by page is still read
    with ``pread`` under ``auto`` (``mmap`` pins the mapping).  The cost: kept
    files' pages count in the process's resident memory (shared with the page cache, not
    a second copy), and a deleted or replaced file's blocks stay allocated until its mapping
    is dropped (by the next load that maps a file anew, or here).  Same as ``ENGINE_KEEP_MAPPINGS=1`` at start-up.
    Files on network mounts are never mapped (see :func:`engine.io.reader.copy_mapping`).
    """
    with KEPT_MAPPINGS.lock:
        KEPT_MAPPINGS.on = bool(on)
    if not on:
        KEPT_MAPPINGS.release()
