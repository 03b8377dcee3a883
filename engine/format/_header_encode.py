"""The header of a safetensors file as the writer encodes it: checked entries and metadata to
the reference's bytes (tensors sorted by dtype code descending, then by name; compact JSON as
``serde_json`` writes it, padded with spaces to a multiple of 8), and each tensor's offset.

The inverse of :mod:`engine.format.header`, and as strict: whatever this encodes, the readers accept.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from engine.base.dtypes import BITS, DTYPES, NAMES, code_of
from engine.errors import SerializationError, SerializationTypeError
from engine.format.header import MAX_HEADER_SIZE

__all__ = ["build_header", "check_name", "check_metadata", "dtype_code", "checked_shape", "packed_nbytes",
           "METADATA_KEY"]

METADATA_KEY = "__metadata__"


def build_header(
    entries: Iterable[tuple[str, int, Sequence[int], int]],
    metadata: Mapping[str, str] | None = None,
    *,
    max_header_size: int = MAX_HEADER_SIZE,
) -> tuple[bytes, list[tuple[int, int]]]:
    """Header bytes and tensor placement for a file holding ``entries``.

    Parameters
    ----------
    entries : iterable of (name, dtype_code, shape, nbytes)
        One tuple per tensor, in any order.  ``dtype_code`` is an :mod:`engine.base.dtypes`
        code (a format name such as ``"BF16"`` is accepted too); ``shape`` counts elements,
        also for the sub-byte dtypes; ``nbytes`` must equal the shape's packed size.
    metadata : mapping of str to str, optional
        Written as ``__metadata__``, first and in the mapping's order.  ``None`` omits the
        key; an empty mapping writes ``"__metadata__":{}`` as the reference does.
    max_header_size : int, default 100,000,000
        Largest header (JSON and padding, in bytes) written; the readers' limit of the same
        name, so that a file this writes is one they accept.

    Returns
    -------
    header : bytes
        The 8-byte little-endian length, the JSON and its space padding: the first
        ``len(header)`` bytes of the file.
    layout : list of (int, int)
        ``(index into entries, absolute file offset)`` for every tensor, in layout order:
        writing the tensors in this order after the header fills the file front to back.
        The file is ``len(header) + sum(nbytes)`` bytes long.

    Raises
    ------
    SerializationError
        A name that is not a string, is ``__metadata__``, is not UTF-8 encodable or occurs
        twice; an unknown dtype; a negative dimension; ``nbytes`` that does not match the
        shape, or a sub-byte tensor that does not end on a byte boundary; metadata keys or
        values that are not strings; ``reason="HeaderTooLarge"``: a header longer than
        ``max_header_size``, which readers would refuse.

    Notes
    -----
    Layout and JSON follow the reference: dtype code descending (the codes follow its
    dtype enum), then name in code-point order (which is UTF-8 byte order); strings
    escaped as by ``json.dumps(ensure_ascii=False)``, which escapes exactly what
    ``serde_json`` escapes.  No padding between tensors: descending codes put the larger
    item sizes first, so every tensor stays aligned to its item size.
    """
    checked = []
    seen = set()
    for index, (name, dtype, shape, nbytes) in enumerate(entries):
        check_name(name)
        if name in seen:
            raise SerializationError(
                f"tensor {name!r} is listed twice", reason="DuplicateKey", tensors=(name,)
            )
        seen.add(name)
        code = dtype_code(name, dtype)
        shape = checked_shape(name, shape)
        expected = packed_nbytes(name, code, shape)
        if operator.index(nbytes) != expected:
            raise SerializationError(
                f"tensor {name!r}: {nbytes} bytes given, {NAMES[code]}{list(shape)} takes {expected}",
                reason="TensorInvalidInfo",
                tensors=(name,),
            )
        checked.append((-code, name, index, shape, expected))
    checked.sort()

    doc: dict[str, Any] = {}
    if metadata is not None:
        doc[METADATA_KEY] = check_metadata(metadata)
    layout = []
    begin = 0
    for neg_code, name, index, shape, nbytes in checked:
        doc[name] = {"dtype": NAMES[-neg_code], "shape": list(shape), "data_offsets": [begin, begin + nbytes]}
        layout.append((index, begin))
        begin += nbytes

    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > max_header_size:
        raise SerializationError(
            f"the header would take {len(text)} bytes, more than the limit of {max_header_size} that "
            "readers accept (fewer tensors per file, shorter names or metadata; or raise max_header_size "
            "here and when reading)",
            reason="HeaderTooLarge",
        )
    start = 8 + len(text)
    return len(text).to_bytes(8, "little") + text, [(index, start + offset) for index, offset in layout]


def check_name(name: object) -> None:
    """Refuse a tensor name that the format cannot hold: not a string, ``__metadata__``, not UTF-8."""
    if not isinstance(name, str):
        raise SerializationTypeError(
            f"tensor names must be strings, got {type(name).__name__} {name!r}", reason="InvalidTensorName"
        )
    if name == METADATA_KEY:
        raise SerializationError(
            f"{METADATA_KEY!r} is reserved for metadata and cannot name a tensor",
            reason="InvalidTensorName",
            tensors=(name,),
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SerializationError(
            f"tensor name {name!r} cannot be encoded as UTF-8 ({exc.reason})",
            reason="InvalidTensorName",
            tensors=(name,),
        ) from None


def check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """``metadata`` as a dict, once every key and value is checked to be a UTF-8 encodable string."""
    if not isinstance(metadata, Mapping):
        raise SerializationTypeError(
            f"metadata must be a mapping of str to str, got {type(metadata).__name__}",
            reason="InvalidMetadata",
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SerializationTypeError(
                f"metadata keys and values must be strings, got {key!r}: {value!r}", reason="InvalidMetadata"
            )
        try:
            key.encode("utf-8")
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise SerializationError(
                f"metadata {key!r}: {value!r} cannot be encoded as UTF-8", reason="InvalidMetadata"
            ) from None
    return dict(metadata)


def dtype_code(name: str, dtype: int | str) -> int:
    """The :mod:`engine.base.dtypes` code of ``dtype`` (a code or a format name such as ``"BF16"``)."""
    try:
        code = code_of(dtype) if isinstance(dtype, str) else operator.index(dtype)
    except (SerializationError, TypeError):
        code = -1
    if not 0 <= code < len(DTYPES):
        raise SerializationError(
            f"tensor {name!r}: unknown dtype {dtype!r}", reason="InvalidDtype", tensors=(name,)
        )
    return code


def checked_shape(name: str, shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints."""
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        dims = (-1,)
    if any(d < 0 for d in dims):
        raise SerializationError(
            f"tensor {name!r}: invalid shape {shape!r}", reason="InvalidShape", tensors=(name,)
        )
    return dims


def packed_nbytes(name: str, code: int, shape: tuple[int, ...]) -> int:
    """Bytes of a ``code`` tensor of ``shape``; refuses sub-byte tensors that end inside a byte."""
    numel = 1
    for d in shape:
        numel *= d
    bits = numel * BITS[code]
    if bits % 8:
        raise SerializationError(
            f"tensor {name!r}: {NAMES[code]}{list(shape)} does not end on a byte boundary",
            reason="MisalignedSlice",
            tensors=(name,),
        )
    return bits // 8
