"""Proof that a native call releases the GIL: a Python thread keeps counting while it runs."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable


def ticks_during(work: Callable[[], object]) -> int:
    """How many times a spinning Python thread counted while ``work()`` ran.

    The switch interval is raised to 100 s for the call, so the interpreter never takes the
    GIL away from ``work`` by itself: the spinner counts only if ``work`` gives the GIL up.
    """
    ticks = [0]
    started, stop = threading.Event(), threading.Event()

    def spin() -> None:
        started.set()
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)

    old = sys.getswitchinterval()
    sys.setswitchinterval(100)
    t = threading.Thread(target=spin)
    try:
        t.start()
        started.wait()
        before = ticks[0]
        work()
        return ticks[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(old)
        t.join()
