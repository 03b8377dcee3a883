"""A process's host memory by kind while a load runs, sampled on a thread.

From ``/proc/self/status``: anonymous pages (``RssAnon``: heap, page-locked buffers made from
anonymous mappings, a host copy of the model), file-backed mapped pages (``RssFile``: a
file's mapping, which the kernel can drop and the page cache holds anyway) and
``mlock``-ed pages (``VmLck``); and the bytes the engine's rings hold page-locked, by the
engine's own count (``engine.gpu.rings.locked_bytes()``: ``cudaHostRegister`` locks pages
without ``mlock``, so ``VmLck`` does not see them).  A process's total resident size mixes
the kinds; a device load's host cost is what it adds to the anonymous and page-locked
memory (scripts/gpu_check.py bounds that sum), while mapped file pages are the page cache
seen through a mapping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

#: the fields of ``/proc/self/status`` sampled, as this module's keys
FIELDS = {"RssAnon": "anon", "RssFile": "file", "VmLck": "vmlck"}
_UNITS = {"kB": 1024, "mB": 1 << 20, "gB": 1 << 30, "B": 1}


def parse_status(text: str) -> dict[str, int]:
    """Bytes of :data:`FIELDS` in the text of ``/proc/<pid>/status`` (``anon``, ``file``,
    ``vmlck``); a field the kernel does not report is left out."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        key = FIELDS.get(name.strip())
        if key is None:
            continue
        parts = value.split()
        try:
            out[key] = int(parts[0]) * _UNITS.get(parts[1] if len(parts) > 1 else "B", 1024)
        except (IndexError, ValueError):
            continue
    return out


def read_status(path: str = "/proc/self/status") -> dict[str, int]:
    """:func:`parse_status` of this process now; empty where there is no ``/proc``."""
    try:
        with open(path) as f:
            return parse_status(f.read())
    except OSError:
        return {}


def engine_locked() -> Callable[[], int]:
    """``engine.gpu.rings.locked_bytes`` when the engine is importable, else a count of 0
    (a peer's row in a process without the engine)."""
    try:
        from engine.gpu import rings
    except Exception:  # the engine is not what this process measures
        return lambda: 0
    return rings.locked_bytes


class Sampler:
    """Samples host memory by kind every ``interval`` seconds between ``__enter__`` and
    ``__exit__`` (and once at each end); :meth:`result` gives the peak growth of each kind
    over the first sample.

    ``locked``: the page-locked count to sample (default :func:`engine_locked`).  The engine's
    ring chunks are anonymous mappings locked in place, so once touched they count in
    ``anon`` as well as in ``locked``: the sum of the two is an upper bound of what a load
    holds."""

    def __init__(self, interval: float = 0.01, locked: Callable[[], int] | None = None) -> None:
        self.interval = interval
        self.locked = locked or engine_locked()
        self.base: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def snapshot(self) -> dict[str, int]:
        s = read_status()
        s["locked"] = int(self.locked())
        return s

    def _take(self) -> None:
        s = self.snapshot()
        with self._lock:
            self.samples += 1
            grown = {k: v - self.base.get(k, 0) for k, v in s.items()}
            # the bound's quantity, from one sample: peaks of the two kinds may come apart
            grown["anon_locked"] = grown.get("anon", 0) + grown["locked"]
            for k, v in grown.items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            self.peak["locked_abs"] = max(self.peak.get("locked_abs", 0), s["locked"])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def __enter__(self) -> Sampler:
        self.base = self.snapshot()
        self._take()
        self._thread = threading.Thread(target=self._run, name="host-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._take()

    def result(self) -> dict[str, int]:
        """Peak growth over the first sample, bytes: ``anon_growth_bytes``,
        ``file_growth_bytes``, ``vmlck_growth_bytes``, ``locked_growth_bytes``,
        ``anon_locked_growth_bytes`` (the largest sum of the two in one sample), and
        ``locked_peak_bytes`` (the engine's count itself), ``memory_samples``."""
        with self._lock:
            peak = dict(self.peak)
        out = {f"{k}_growth_bytes": max(0, peak.get(k, 0)) for k in ("anon", "file", "vmlck", "locked")}
        out["anon_locked_growth_bytes"] = max(0, peak.get("anon_locked", 0))
        out["locked_peak_bytes"] = peak.get("locked_abs", 0)
        out["memory_samples"] = self.samples
        return out

    def file_now(self) -> int:
        """Growth of the mapped file pages now over the first sample (after a load: what it
        left mapped), bytes."""
        return read_status().get("file", 0) - self.base.get("file", 0)

