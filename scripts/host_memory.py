"""A process's host memory by kind while a load runs, sampled on a thread.

``RssAnon`` (heap, page-locked buffers, a host copy of the model), ``RssFile`` (mapped file pages: the
page cache seen through a mapping) and ``VmLck`` from ``/proc/self/status``, and the engine's own count of
the bytes its rings hold page-locked (``cudaHostRegister`` locks pages without ``mlock``: ``VmLck`` misses
them).  A device load's host cost is what it adds to the anonymous and page-locked memory together.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

#: the fields of ``/proc/self/status`` sampled, as this module's keys
FIELDS = {"RssAnon": "anon", "RssFile": "file", "VmLck": "vmlck"}


def parse_status(text: str) -> dict[str, int]:
    """Bytes of :data:`FIELDS` in a ``/proc/<pid>/status`` text; a field not reported is left out."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if (key := FIELDS.get(name.strip())) is not None and parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024  # the kernel reports kB
    return out


def read_status(path: str = "/proc/self/status") -> dict[str, int]:
    """:func:`parse_status` of this process now; empty where there is no ``/proc``."""
    try:
        with open(path) as f:
            return parse_status(f.read())
    except OSError:
        return {}


def engine_locked() -> Callable[[], int]:
    """``engine.gpu.rings.locked_bytes``, or a count of 0 in a process without the engine (a peer's row)."""
    try:
        from engine.gpu import rings
    except Exception:
        return lambda: 0
    return rings.locked_bytes


class Sampler:
    """Host memory by kind every ``interval`` seconds inside the ``with`` block (and once at each end).

    ``locked``: the page-locked count (default :func:`engine_locked`).  The ring's chunks are anonymous
    mappings locked in place, so they count in ``anon`` and in ``locked``: the sum is an upper bound."""

    def __init__(self, interval: float = 0.01, locked: Callable[[], int] | None = None) -> None:
        self.interval, self.locked = interval, locked or engine_locked()
        self.base: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-memory", daemon=True)
        self._lock = threading.Lock()

    def snapshot(self) -> dict[str, int]:
        return {**read_status(), "locked": int(self.locked())}

    def _take(self) -> None:
        s = self.snapshot()
        with self._lock:
            self.samples += 1
            grown = {k: v - self.base.get(k, 0) for k, v in s.items()}
            # the bound's quantity from one sample: the peaks of the two kinds may come apart
            grown["anon_locked"] = grown.get("anon", 0) + grown["locked"]
            grown["locked_abs"] = s["locked"]
            for k, v in grown.items():
                self.peak[k] = max(self.peak.get(k, 0), v)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def __enter__(self) -> Sampler:
        self.base = self.snapshot()
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def result(self) -> dict[str, int]:
        """Peak growth over the first sample, bytes (``<kind>_growth_bytes``, ``anon_locked_growth_bytes``),
        the engine's locked peak itself (``locked_peak_bytes``) and ``memory_samples``."""
        with self._lock:
            peak = dict(self.peak)
        out = {f"{k}_growth_bytes": max(0, peak.get(k, 0)) for k in ("anon", "file", "vmlck", "locked", "anon_locked")}
        return {**out, "locked_peak_bytes": peak.get("locked_abs", 0), "memory_samples": self.samples}

    def file_now(self) -> int:
        """Growth of the mapped file pages now over the first sample (after a load: what it left mapped)."""
        return read_status().get("file", 0) - self.base.get("file", 0)
