"""The package's thread helpers: a map over items on a bounded pool, and a set of jobs each
on a thread of its own.  Every caller (reads, shard opens and writes, downloads, device
loads) uses these two, so each gets the same guarantee: no call is left running when the
first error reaches the caller.

:mod:`engine.io.reader` re-exports both, their public home.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["map_threads", "run_threads"]


def map_threads(
    fn,
    items: Sequence,
    max_workers: int,
    *,
    name: str = "engine",
    inline_under: float | None = None,
    undo: Callable | None = None,
) -> list:
    """``[fn(x) for x in items]`` on up to ``max_workers`` threads (inline for one item or
    one worker).

    Every call finishes before the first exception, in item order, is raised: no call is
    left running when the caller cleans up after a failure.  Inline calls stop at the first
    failure.

    Parameters
    ----------
    inline_under : float, optional
        Run the first item inline, and the rest on threads only if it took longer than this
        many seconds (handing a fast call to a thread costs more than the call).
    undo : callable, optional
        On a failure, called with each result that did succeed (e.g. to close what was
        opened) before the exception is raised.
    """
    items = list(items)
    outcomes: list[tuple[bool, object]] = []

    def call(x) -> tuple[bool, object]:
        try:
            return True, fn(x)
        except BaseException as exc:  # raised in the caller, once every call has ended
            return False, exc

    rest = items
    if inline_under is not None and items:
        t0 = time.perf_counter()
        outcomes.append(call(items[0]))
        rest = items[1:]
        if time.perf_counter() - t0 <= inline_under:
            max_workers = 1
    if outcomes and not outcomes[0][0]:
        rest = []
    if len(rest) <= 1 or max_workers <= 1:
        for x in rest:
            outcomes.append(call(x))
            if not outcomes[-1][0]:
                break
    else:
        from concurrent.futures import ThreadPoolExecutor  # opening a file needs no thread pool

        with ThreadPoolExecutor(min(max_workers, len(rest)), thread_name_prefix=name) as pool:
            outcomes += list(pool.map(call, rest))
    failed = next((value for ok, value in outcomes if not ok), None)
    if failed is not None:
        if undo is not None:
            for ok, value in outcomes:
                if ok:
                    undo(value)
        raise failed  # type: ignore[misc]
    return [value for _, value in outcomes]


def run_threads(jobs, *, name: str = "engine-read", on_error=None) -> None:
    """Run each job on a thread of its own (a single job on the calling thread) and join.

    The first exception of any job is re-raised once every thread has ended, so no thread
    outlives the call; ``on_error()`` runs as soon as a job fails (e.g. to tell the others
    to stop).
    """
    errors: list[BaseException] = []

    def guarded(job) -> None:
        try:
            job()
        except BaseException as exc:  # re-raised in the caller below
            errors.append(exc)
            if on_error is not None:
                on_error()

    if len(jobs) == 1:
        guarded(jobs[0])
    else:
        workers = [threading.Thread(target=guarded, args=(job,), name=f"{name}-{i}", daemon=True)
                   for i, job in enumerate(jobs)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    if errors:
        raise errors[0]
