"""``memory_limit=``: the host memory a load may hold beyond its outputs, and what it sizes.

One planner for every load path.  ``None`` is the path's default plan; ``N`` bytes bounds what
the engine stages on the host while it loads (round buffers of a group load, chunks in flight
of a remote or device load), never the outputs the caller asked for; ``0`` asks for the least a
path can do, the largest tensor where a tensor must be staged whole.  A limit a path cannot
meet is an :class:`~engine.errors.OptionError` naming both figures, before anything is read.
"""

from __future__ import annotations

from engine.errors import OptionError

__all__ = ["checked", "whole_tensors", "rounds", "in_flight", "ring_chunk"]


def checked(limit) -> int | None:
    """``limit`` as given to a load: ``None`` or a count of bytes >= 0."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise OptionError(f"memory_limit must be None or a number of bytes >= 0, not {limit!r}",
                          option="memory_limit")
    return int(limit)


def whole_tensors(limit: int, largest: int, where: str | None = None) -> int:
    """The bytes a path that stages each tensor whole may hold: ``limit``, or the largest
    tensor's size for ``0``; below it, an error naming both."""
    if limit == 0:
        return largest
    if limit < largest:
        raise OptionError(f"memory_limit={limit} bytes is below the largest tensor's {largest} bytes, which this "
                          "load stages whole: give at least that, or 0 for exactly that", option="memory_limit",
                          reason="MemoryLimitTooLow", path=where)
    return limit


def rounds(limit: int | None, largest: int, round_bytes: int, where: str | None = None) -> tuple[int, int]:
    """``(round bytes, rounds in flight)`` of a load that stages whole tensors in rounds of at
    most ``round_bytes`` (a larger tensor is a round of its own): two rounds in flight, so that
    one is read while the other is handed out, where the limit holds two; else one.  Without a
    limit, the default: two rounds of ``round_bytes``."""
    if limit is None:
        return max(1, round_bytes), 2
    limit = whole_tensors(limit, largest, where)
    if limit >= 2 * largest and limit >= 2:
        return max(1, min(round_bytes, limit // 2)), 2
    return max(1, min(round_bytes, limit)), 1


def in_flight(limit: int | None, round_bytes: int, largest: int) -> int:
    """Rounds of at most ``max(round_bytes, largest)`` bytes that ``limit`` holds at once (two
    by default), for a round size the group agreed on (at most the one this rank asked for)."""
    if limit is None:
        return 2
    limit = limit or largest
    return 2 if limit >= 2 * max(round_bytes, largest) else 1


def ring_chunk(limit: int, chunks: int) -> int | None:
    """Bytes per chunk (a multiple of 4096) of a ring of ``chunks`` chunks that fits ``limit``,
    or None below the least such ring (``chunks`` chunks of 4096 bytes)."""
    size = limit // max(1, chunks) // 4096 * 4096
    return size or None
