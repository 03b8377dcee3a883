"""A mapping of tensors as a file's contents, checked before any file is touched: each name
and tensor (its bytes as :mod:`engine.writing._tensor_bytes` sees them, no two sharing
memory), the header and every tensor's offset (:func:`engine.format._header_encode.build_header`),
and with ``checksums`` each tensor's CRC-32C and the header's in ``__metadata__``
(:mod:`engine.format.checksums`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.errors import SerializationError
from engine.format import checksums as _checksums
from engine.format._header_encode import build_header, check_name
from engine.writing._tensor_bytes import Raw, check_shared, tensor_bytes

__all__ = ["prepare", "with_checksums"]


def prepare(
    tensors: Mapping[str, Any], metadata: Mapping[str, str] | None, *, max_header_size: int, checksums: bool,
    chunk: int,
) -> tuple[list[tuple[str, Raw]], bytes, list[tuple[int, int]]]:
    """Validate everything, before any file is touched; return the items, header and layout.
    ``chunk``: the most bytes of a tensor read at once for its checksum (the writer's slice)."""
    if not isinstance(tensors, Mapping):
        raise SerializationError(
            f"expected a mapping of names to tensors, got {type(tensors).__name__}", reason="UnsupportedType"
        )
    items = []
    for name, x in tensors.items():
        check_name(name)
        items.append((name, tensor_bytes(name, x)))
    check_shared(items)
    header, layout = build_header(
        ((name, r.code, r.shape, r.nbytes) for name, r in items), metadata, max_header_size=max_header_size
    )
    if checksums:
        header, layout = with_checksums(items, metadata, layout, max_header_size, chunk)
    return items, header, layout


def with_checksums(items, metadata, layout, max_header_size: int, chunk: int):
    """The header and layout again, with every tensor's CRC-32C in the metadata
    (:mod:`engine.format.checksums`): one read of each tensor's bytes before the file is written."""
    if metadata is not None and _checksums.KEY in metadata:
        raise SerializationError(f"metadata key {_checksums.KEY!r} is written by checksums=True; leave it out",
                                 reason="InvalidMetadata")
    ordered = sorted(layout, key=lambda e: (e[1], items[e[0]][0]))
    crcs = []
    for index, _ in ordered:
        crc = 0
        for piece in items[index][1].chunks(chunk):
            crc = _checksums.crc32c(piece, crc)
            del piece
        crcs.append(crc)
    # the header's own CRC, from the same columns a reader takes from the parsed header
    raws = [items[index][1] for index, _ in ordered]
    start = ordered[0][1] if ordered else 0  # the layout's offsets are the file's: the data region's here
    header_crc = _checksums.canonical_digest(
        [items[index][0] for index, _ in ordered], [r.code for r in raws], [tuple(r.shape) for r in raws],
        [begin - start for _, begin in ordered],
        [begin - start + r.nbytes for (_, begin), r in zip(ordered, raws, strict=True)], metadata)
    full = dict(metadata or {})
    full[_checksums.KEY] = _checksums.encode_ordered(crcs, header_crc)
    return build_header(((name, r.code, r.shape, r.nbytes) for name, r in items), full,
                        max_header_size=max_header_size)
