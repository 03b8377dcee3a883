"""Whether loads verify the checksums their files record: one flag per context.

Its own small module, apart from :mod:`engine.format.checksums` (the CRC-32C code, the
entry's parser, the rewrite of a file): a load from a file without checksums asks only this,
and imports none of that.  The flag itself (a context variable) and :func:`verifying` are the
header extension's, so that a first ``safe_open`` asks it without importing this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from engine.format._header import VERIFY as _VERIFY
from engine.format._header import verifying

__all__ = ["verifying", "verification", "KEY", "records_checksums"]

#: The metadata key under which a file records its checksums (:mod:`engine.format.checksums`
#: parses it); here so that a load can ask whether a file records any without importing that.
KEY = "engine.crc32c"

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
