"""When a request is tried again: the one retry policy of every request, and what is transient.

A try that fails is a :class:`Failed` (its error, the bytes it landed, whether it is
transient, the wait the server asked for).  Transient (tried again with capped exponential
backoff and full jitter, :class:`Retry`): a connection refused or reset, a timeout, a body
that ends early, a ``Content-Range`` that does not answer the request, HTTP
408/425/429/500/502/503/504 (after ``Retry-After`` where the server sends one, up to the
retry's cap) and S3's busy codes (``SlowDown``).  Anything else fails at once.  The loops
that retry are the client's (:mod:`engine.net.remote_reads`) and a whole-file stream's
(:mod:`engine.net._whole_file`).
"""

from __future__ import annotations

import http.client
import random
from typing import NamedTuple

from engine.errors import SafetensorError
from engine.net._http import read_error

__all__ = ["Retry", "Failed", "PROGRESS", "fail", "retry_after", "transient", "transient_answer"]

_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_TRANSIENT_S3 = frozenset({"SlowDown", "InternalError", "RequestTimeout", "ServiceUnavailable", "Throttling"})
_TRANSIENT_REASONS = frozenset({"ConnectionError", "Timeout", "ShortRead", "BadRange"})
PROGRESS = 1 << 20  # bytes a failed try must land to count as progress


class Retry(NamedTuple):
    """How transient failures are retried: ``attempts`` tries per range (the first
    included); before try ``k`` a sleep drawn uniformly from ``[0, min(cap, base * 2**k)]``
    seconds (full jitter)."""

    attempts: int = 6
    base: float = 0.1
    cap: float = 5.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.cap, self.base * (2.0 ** attempt)))


def transient(err: SafetensorError) -> bool:
    """Whether a request that failed with ``err`` may succeed when tried again: the
    connection failed or the body ended early, a timeout, an answer for another range, or
    an HTTP status of a busy or failing server (408, 425, 429, 500, 502, 503, 504; S3's
    ``SlowDown`` is a 503)."""
    return err.reason in _TRANSIENT_REASONS or getattr(err, "status", None) in _TRANSIENT_STATUS


def transient_answer(status: int, code: str) -> bool:
    """Whether an error answer (its HTTP ``status``, the S3 error ``code`` of its body) is a
    busy or failing server's."""
    return status in _TRANSIENT_STATUS or code in _TRANSIENT_S3


class Failed(Exception):
    """A try that failed after ``landed`` bytes; ``error`` is what the caller would see;
    ``after``: seconds the server asked to wait before the next try (``Retry-After``)."""

    def __init__(self, error: SafetensorError, landed: int, transient: bool, after: float = 0.0) -> None:
        super().__init__(str(error))
        self.error = error
        self.landed = landed
        self.transient = transient
        self.after = after


def fail(name: str, offset: int, want: int, reason: str, what: str, landed: int,
         transient: bool | None = None) -> Failed:
    """The failure of a try at ``want`` bytes from ``offset`` of ``name`` that landed
    ``landed``: transient by its ``reason`` unless ``transient`` says."""
    where = f"bytes {offset}-{offset + want - 1}: " if want > 0 else ""  # a whole answer (an API's) has no range
    err = read_error(f"{where}{what}", name, reason, offset=offset, size=want)
    return Failed(err, landed, reason in _TRANSIENT_REASONS if transient is None else transient)


def retry_after(resp: http.client.HTTPResponse, cap: float) -> float:
    """The seconds of a ``Retry-After: N`` header (a date is read as no wait), at most ``cap``."""
    value = (resp.getheader("Retry-After") or "").strip()
    return min(float(value), cap) if value.isdigit() else 0.0
