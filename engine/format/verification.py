"""Whether loads verify the checksums their files record: one flag per context.

Its own small module, apart from :mod:`engine.format.checksums` (the CRC-32C code, the
entry's parser, the rewrite of a file): a first ``safe_open`` of a file without checksums
asks only this, and imports none of that.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["verifying", "verification", "KEY", "records_checksums"]

#: The metadata key under which a file records its checksums (:mod:`engine.format.checksums`
#: parses it); here so that a load can ask whether a file records any without importing that.
KEY = "engine.crc32c"

_VERIFY: contextvars.ContextVar[bool] = contextvars.ContextVar("engine_verify_checksums", default=True)


def verifying() -> bool:
    """Whether loads started now verify the checksums their files carry (default True)."""
    return _VERIFY.get()


def records_checksums(metadata) -> bool:
    """Whether a header's ``metadata`` (a dict or None) carries the checksum entry."""
    return metadata is not None and KEY in metadata


@contextlib.contextmanager
def verification(enabled: bool | None) -> Iterator[None]:
    """Loads started inside the block verify checksums (``True``) or skip them (``False``);
    ``None`` keeps what the surrounding code chose.  The entry points' ``verify_checksums=``
    arguments set this for their own call."""
    if enabled is None:
        yield
        return
    token = _VERIFY.set(bool(enabled))
    try:
        yield
    finally:
        _VERIFY.reset(token)
