"""Per-tensor checksums: CRC-32C recorded in the header, verified as the bytes are copied.

A file carries one CRC-32C (Castagnoli, as iSCSI, ext4 and Google Cloud Storage use it:
``crc32c(b"123456789") == 0xE3069283``) per tensor in its ``__metadata__`` under the key
:data:`KEY`.  The value is ``"2:"``, eight lower-case hex digits of the header's own CRC
(:func:`header_digest`: every tensor's name, dtype, shape and offsets and the metadata but
this entry, in a canonical form, so that any JSON spelling of the same header agrees), then
eight per tensor, the tensors taken in file order (by data offset; tensors at the same
offset, which only empty ones can share with another, by name).  Files of the first format,
``"1:"`` and the tensors' digits alone, are read as before (their header is not covered).
The reference ``safetensors`` reads such a file unchanged: ``__metadata__`` is a
string-to-string map and this is one string in it.  A header damaged in a way that still
parses (a name, a dtype, a shape) fails the header's CRC before any tensor is handed out.

Why positional hex and not ``name:hex`` pairs or JSON: the names are already in the header,
and repeating them would double a header of 100,000 tensors with long names; JSON inside a
JSON string is escaped quote by quote.  Nine bytes per tensor (with the separator-free
digits, eight) parse with one ``bytes.fromhex`` and one array view, no Python per tensor;
the entry is checked against the header (its length must be exactly eight digits per
tensor) and never trusted for sizes.

Loads verify by default when the entry is present (see :func:`verification`): each
tensor's CRC is computed where its bytes are copied (in the copy threads, block by block
while the block is in the cache) and compared before the tensor is handed out.  A mismatch
raises :class:`~engine.errors.ChecksumError` naming the file, the tensor, and both values.
Files without the entry load as before, with no checksum work at all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.base import _crc32c
from engine.base._atomic import AtomicFile, sync_dir
from engine.base._atomic import umask as _umask
from engine.base._atomic import write_error as _write_error
from engine.errors import ChecksumError, ReadError
from engine.format.header import Header, read_header_fd
from engine.format.verification import KEY, records_checksums, verification, verifying  # noqa: F401  (the names every load reaches here)

__all__ = [
    "KEY",
    "VERSION",
    "crc32c",
    "combine",
    "hardware",
    "encode",
    "expected",
    "has_checksums",
    "check",
    "mismatch",
    "verification",
    "verifying",
    "file_digests",
    "add_checksums",
    "header_digest",
    "canonical_digest",
]

#: the format of the entry's value that writers write (its prefix, ``"2:"``: the header's
#: CRC first); ``"1:"`` (the tensors' alone) is still read
VERSION = "2"
_PREFIX = VERSION + ":"
_V1 = "1:"



def crc32c(data, crc: int = 0, *, hardware: bool = True) -> int:
    """The CRC-32C of ``data`` (bytes or any C-contiguous buffer: an array's bytes as
    stored), continuing ``crc`` (0 to start); GIL released.  ``hardware=False`` forces the
    table (what a CPU without SSE4.2 uses)."""
    try:
        return _crc32c.crc32c(data, crc, hardware)
    except ValueError:  # a typed buffer (float32 ...): its bytes
        return _crc32c.crc32c(memoryview(data).cast("B"), crc, hardware)

combine = _crc32c.combine
combine_rows = _crc32c.combine_rows
spans = _crc32c.spans
hardware = _crc32c.hardware

def _file_order(header: Header) -> list[int]:
    """Rows in the order of the entry's digests: by data offset, ties by name."""
    import numpy as np

    table = header.table
    order = np.asarray(table.order)
    begins = np.asarray(table.begins)[order]
    ties = np.flatnonzero(np.diff(begins) == 0)
    if not ties.size:  # the common case: no empty tensor shares an offset
        return order.tolist()
    out = order.tolist()
    names = table.names
    i, n = 0, len(out)
    while i < n:  # ties (empty tensors) are rare: sort only the runs that share an offset
        j = i + 1
        while j < n and begins[j] == begins[i]:
            j += 1
        if j - i > 1:
            out[i:j] = sorted(out[i:j], key=lambda r: names[r])
        i = j
    return out


def encode(header: Header, digests: Mapping[str, int] | Sequence[int],
           metadata: Mapping[str, str] | None = None) -> str:
    """The entry's value for ``header``'s tensors: ``digests`` by name, or per row; the
    header's CRC over its tensors and ``metadata`` (default its own)."""
    names = header.table.names
    if isinstance(digests, Mapping):
        values = [int(digests[names[r]]) for r in _file_order(header)]
    else:
        values = [int(digests[r]) for r in _file_order(header)]
    return encode_ordered(values, header_digest(header, metadata))


def encode_ordered(values: Sequence[int], header_crc: int) -> str:
    """The entry's value from the header's CRC and the digests already in the entry's order
    (file order)."""
    return _PREFIX + f"{header_crc & 0xFFFFFFFF:08x}" + "".join(f"{v & 0xFFFFFFFF:08x}" for v in values)


def header_digest(header: Header, metadata: Mapping[str, str] | None = None) -> int:
    """The CRC-32C of ``header`` in canonical form (:func:`canonical_digest` of its rows in
    file order), with ``metadata`` (default the header's own) but the checksum entry."""
    table = header.table
    rows = _file_order(header)
    names = table.names
    shapes = table.shapes
    return canonical_digest([names[r] for r in rows], [int(c) for c in _taken(table.codes, rows)],
                            [shapes[r] for r in rows], _taken(table.begins, rows), _taken(table.ends, rows),
                            header.metadata if metadata is None else metadata)


def _taken(column, rows: list[int]) -> list[int]:
    import numpy as np

    return np.asarray(column)[np.asarray(rows, dtype=np.intp)].tolist()


def canonical_digest(names: Sequence[str], codes: Sequence[int], shapes: Sequence[Sequence[int]],
                     begins: Sequence[int], ends: Sequence[int], metadata: Mapping[str, str] | None) -> int:
    """The CRC-32C of a header's canonical form: the tensors in file order, each its name (UTF-8),
    a NUL, its dtype code, rank, dimensions and offsets as little-endian 64-bit integers; then
    the metadata but the checksum entry, as compact JSON with sorted keys.  The writers and
    the readers compute it from the same columns, so that it never depends on the JSON's
    spelling."""
    import json
    from itertools import chain

    import numpy as np

    crc = crc32c("\x00".join(names).encode("utf-8"))
    ranks = [len(s) for s in shapes]
    ints = np.fromiter(chain(codes, ranks, chain.from_iterable(shapes), begins, ends), dtype="<u8")
    crc = crc32c(ints.tobytes(), crc)
    md = {k: v for k, v in (metadata or {}).items() if k != KEY}
    return crc32c(json.dumps(md, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8"), crc)


def has_checksums(header: Header) -> bool:
    """Whether ``header`` carries the checksum entry (well formed or not)."""
    return records_checksums(header.metadata)


def expected(header: Header, path: str | None = None) -> Any:
    """Each row's recorded CRC-32C (a ``numpy.uint32`` array in header order), or None when
    the file records none.

    Raises
    ------
    ChecksumError
        ``reason="InvalidChecksums"``: the entry is not ``"2:"`` and eight hex digits for the
        header and per tensor (or ``"1:"`` and eight per tensor); ``reason="HeaderChecksumMismatch"``:
        the header's CRC (:func:`header_digest`) is not the one recorded (a damaged name,
        dtype, shape, offset or metadata).
    """
    md = header.metadata
    if md is None or KEY not in md:
        return None
    import numpy as np

    value = md[KEY]
    n = len(header.table.names)
    where = path if path is not None else header.path

    def bad(why: str) -> ChecksumError:
        return ChecksumError(f"the {KEY!r} metadata entry {why}", reason="InvalidChecksums", path=where)

    if value.startswith(_PREFIX):
        digits, covered = value[len(_PREFIX):], True
    elif value.startswith(_V1):
        digits, covered = value[len(_V1):], False
    else:
        raise bad(f"does not start with {_PREFIX!r} or {_V1!r} (an unknown format or not a checksum list)")
    want = 8 * n + (8 if covered else 0)
    if len(digits) != want:
        raise bad(f"holds {len(digits)} hex digits where the header{' and its' if covered else chr(39) + 's'} "
                  f"{n} tensors take {want}")
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        raise bad("holds characters that are not hex digits") from None
    if any(c in digits for c in " \t\n\r"):
        raise bad("holds white space")
    values = np.frombuffer(raw, dtype=">u4")
    if covered:
        recorded, values = int(values[0]), values[1:]
        got = header_digest(header)
        if got != recorded:
            raise ChecksumError(
                f"the header's CRC-32C is {got:08x}, the file records {recorded:08x}: a tensor's name, dtype, "
                "shape or offsets, or the metadata, changed after the file was written (the header is damaged, "
                "or edited by a tool that kept the old checksums: engine.add_checksums records them again; "
                "verify_checksums=False loads it unchecked)",
                reason="HeaderChecksumMismatch", path=where, expected=recorded, computed=got)
    out = np.empty(n, dtype=np.uint32)
    out[np.asarray(_file_order(header), dtype=np.intp)] = values
    return out


def mismatch(path: str | None, name: str, want: int, got: int) -> ChecksumError:
    """The error for tensor ``name`` of ``path`` whose bytes' CRC-32C is ``got``, not ``want``."""
    return ChecksumError(
        f"tensor {name!r}: CRC-32C of its bytes is {got:08x}, the file records {want:08x} "
        "(the file is corrupt or was changed after it was written)",
        reason="ChecksumMismatch", path=path, tensors=(name,), expected=int(want), computed=int(got),
    )


#: reads more of a tensor whose bytes came over a network and failed their checksum: until
#: the recorded checksum comes, or two reads agree (the server's own bytes are damaged)
REREADS = 3


def read_until_agreed(first: int, want: int, again: Callable[[], int]) -> tuple[int, bool]:
    """Read a tensor again (``again()``: its new CRC-32C) after a first read of CRC ``first``
    failed: until ``want`` comes, two reads agree, or :data:`REREADS` more reads.  Returns
    ``(the last CRC, whether two reads agreed)``."""
    seen = {first}
    crc = first
    for _ in range(REREADS):
        crc = again()
        if crc == want:
            return crc, False
        if crc in seen:
            return crc, True
        seen.add(crc)
    return crc, False


def read_again(err: ChecksumError, again: int, agreed: bool) -> ChecksumError:
    """``err``, a mismatch of bytes that came over a network, once the tensor was read again
    (:func:`read_until_agreed`) and its last CRC-32C was ``again``: the message says whether
    two reads agreed (the file itself is damaged) or every read differed."""
    note = (f"read again from the server: the same bytes twice ({again:08x}), so the file itself is damaged"
            if agreed else
            f"read {REREADS + 1} times from the server, different bytes each time (last {again:08x}): damaged on "
            "the way every time")
    err.message = f"{err.message} ({note})"
    err.args = (err.message,)
    return err


def verify_received(checks: Checks | None, row: int, data, receive_again: Callable[[], None]) -> None:
    """Verify ``data``, row ``row``'s whole bytes just received over a network (nothing where
    ``checks`` is None); on a mismatch ``receive_again()`` reads them into ``data`` again from
    the server (:func:`read_until_agreed`), and only a mismatch that stays raises
    (:func:`read_again`'s error)."""
    if checks is None:
        return
    try:
        checks.verify_bytes(row, data)
    except ChecksumError as err:
        if not len(data):
            raise

        def again() -> int:
            receive_again()
            return crc32c(data)

        want = int(checks.expected[row])
        crc, agreed = read_until_agreed(int(getattr(err, "computed", -1)), want, again)
        if crc != want:
            raise read_again(err, crc, agreed) from None


def check(path: str | None, name: str, want: int, data) -> None:
    """Raise :func:`mismatch`'s error unless ``data``'s CRC-32C is ``want`` (one pass over
    ``data``, GIL released)."""
    got = crc32c(data)
    if got != int(want):
        raise mismatch(path, name, int(want), got)


# -- whole files ---------------------------------------------------------------------------

#: bytes read per step when a whole file is checksummed or rewritten
STEP_BYTES = 8 << 20


def _read_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from the file at ``offset`` (short reads continued)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise ReadError(f"the file ends at {offset + done}, inside the data", path=path,
                            offset=offset, size=len(view))
        done += n


def _digests_of(fd: int, header: Header, path: str, sink=None) -> list[int]:
    """CRC-32C of every tensor in the entry's order, reading the data region once front to
    back in steps of :data:`STEP_BYTES` into one buffer (``sink(view, offset)`` sees each
    step, right after its checksums, while it is in the cache)."""
    table = header.table
    order = _file_order(header)
    begins = [int(table.begins[r]) for r in order]
    ends = [int(table.ends[r]) for r in order]
    crcs = [0] * len(order)
    start = header.data_start
    pos, size = 0, header.data_size
    buf = memoryview(bytearray(min(STEP_BYTES, size)))
    k = 0  # the first tensor that ends after pos
    while pos < size:
        n = min(STEP_BYTES, size - pos)
        view = buf[:n]
        _read_into(fd, view, start + pos, path)
        hi = pos + n
        j = k
        while j < len(order) and begins[j] < hi:
            a, b = max(begins[j], pos), min(ends[j], hi)
            if b > a:
                crcs[j] = _crc32c.crc32c(view[a - pos : b - pos], crcs[j], True)
            j += 1
        while k < len(order) and ends[k] <= hi:
            k += 1
        if sink is not None:
            sink(view, pos)
        pos = hi
    return crcs


def file_digests(path: str | os.PathLike[str]) -> dict[str, int]:
    """The CRC-32C of every tensor of the file at ``path``, by name, read front to back once.

    Memory: one step of :data:`STEP_BYTES` at a time.
    """
    p = os.fspath(path)
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        header = read_header_fd(fd, path=p, file_size=os.fstat(fd).st_size)
        crcs = _digests_of(fd, header, p)
        names = header.table.names
        return {names[r]: c for r, c in zip(_file_order(header), crcs, strict=True)}
    finally:
        os.close(fd)


def add_checksums(path: str | os.PathLike[str], *, fsync: bool = True) -> int:
    """Record every tensor's CRC-32C in the file at ``path`` (rewriting it atomically).

    The header grows, so the data region moves: the file is rewritten as a new file in the
    same directory (an unnamed file, or a hidden temporary) and renamed over the old one
    only when complete; a rewrite that is killed leaves the old file intact.  A file that
    already carries checksums gets them recomputed.

    Parameters
    ----------
    path : str or os.PathLike
    fsync : bool, default True
        Sync the new file before the rename and the directory after.

    Returns
    -------
    int
        The number of tensors checksummed.

    Raises
    ------
    HeaderError, ReadError
        The file is not a valid safetensors file.
    WriteError
        Writing or renaming failed; the old file is intact.

    Notes
    -----
    One pass over the data, streamed in steps of :data:`STEP_BYTES` (memory does not grow
    with the file): each step is checksummed and written to the new file; the entry has a
    fixed length (eight digits per tensor), so the header is written first with zero
    digits and overwritten with the real ones at the end.  The data region is kept byte for
    byte, each tensor at its own offset.
    """
    shown = os.fspath(path)  # errors name the path as given
    p = os.path.realpath(shown)  # the file a link points to is the one rewritten
    fd = os.open(shown, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        header = read_header_fd(fd, path=shown, file_size=st.st_size)
        n = len(header.table.names)
        metadata = dict(header.metadata or {})
        header_crc = header_digest(header, metadata)  # the same tensors at the same offsets
        metadata[KEY] = encode_ordered([0] * n, header_crc)
        placeholder = _header_keeping_offsets(header, metadata)
        base = len(placeholder)
        mode = st.st_mode & 0o7777 or (0o666 & ~_umask())
        out = AtomicFile(p, mode)
        try:
            assert out.fd is not None
            ofd = out.fd
            _write_all(ofd, placeholder, 0)
            crcs = _digests_of(fd, header, shown, lambda data, pos: _write_all(ofd, data, base + pos))
            metadata[KEY] = encode_ordered(crcs, header_crc)
            final = _header_keeping_offsets(header, metadata)
            assert len(final) == base
            _write_all(ofd, final, 0)
            if fsync:
                os.fsync(ofd)
            out.commit()
        except ReadError:
            out.discard()
            raise
        except OSError as exc:
            out.discard()
            raise _write_error("rewrite", shown, exc) from exc
        except BaseException:
            out.discard()
            raise
        if fsync:
            sync_dir(os.path.dirname(p) or ".")
        return n
    finally:
        os.close(fd)


def _write_all(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _header_keeping_offsets(header: Header, metadata: Mapping[str, str]) -> bytes:
    """Header bytes for ``header``'s tensors at their own offsets, with ``metadata``."""
    import json

    from engine.format._header_encode import check_metadata

    table = header.table
    names = header.dtypes  # a copy per call: taken once
    doc: dict[str, Any] = {"__metadata__": check_metadata(metadata)}
    for r in table.file_order():
        doc[table.names[r]] = {
            "dtype": names[r],
            "shape": list(table.shapes[r]),
            "data_offsets": [int(table.begins[r]), int(table.ends[r])],
        }
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


#: parsed entries by header table: (the table, its Checks); a few files' worth
_PARSED: dict[int, tuple[Any, Checks]] = {}
_PARSED_MAX = 64


class Checks:
    """What one file's load compares: its recorded digests and where to name a mismatch.

    Made by :meth:`of` for a load that verifies (:func:`verifying`) a file that records
    checksums; None otherwise, and then the load does no checksum work at all.
    """

    __slots__ = ("path", "names", "expected", "sizes")

    def __init__(self, path: str | None, names: list[str], expected, sizes) -> None:
        self.path = path
        self.names = names
        self.expected = expected
        self.sizes = sizes

    @classmethod
    def of(cls, header: Header, path: str | None = None) -> Checks | None:
        """The checks of ``header``'s file, or None (no entry, or verification is off).
        Parsed once per header table (a loop of one-tensor loads parses it once)."""
        if not verifying() or not has_checksums(header):
            return None
        table = header.table
        where = path if path is not None else header.path
        hit = _PARSED.get(id(table))
        if hit is not None and hit[0] is table:
            got = hit[1]
            return got if got.path == where else cls(where, got.names, got.expected, got.sizes)
        made = cls(where, table.names, expected(header, where), table.ends - table.begins)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[id(table)] = (table, made)
        return made

    def verify_views(self, buf, start: int, rows: Sequence[int], begins, ends) -> None:
        """Verify ``rows`` whose bytes are ``buf[start + begins[r] : start + ends[r]]`` (a
        mapping handed out as views): one read of those bytes, natively."""
        import numpy as np

        lo = np.fromiter((start + int(begins[r]) for r in rows), dtype=np.int64, count=len(rows))
        hi = np.fromiter((start + int(ends[r]) for r in rows), dtype=np.int64, count=len(rows))
        got = np.empty(len(rows), dtype=np.uint32)
        spans(buf, lo, hi, got)
        want = self.expected[np.asarray(rows, dtype=np.intp)]
        bad = np.flatnonzero(got != want)
        if bad.size:
            i = int(bad[0])
            raise mismatch(self.path, self.names[rows[i]], int(want[i]), int(got[i]))

    def verify(self, row: int, crc: int) -> None:
        """Raise :class:`~engine.errors.ChecksumError` unless ``crc`` is row ``row``'s."""
        want = int(self.expected[row])
        if int(crc) != want:
            raise mismatch(self.path, self.names[row], want, int(crc))

    def verify_bytes(self, row: int, data) -> None:
        """:meth:`verify` of ``data``'s CRC-32C (one pass, GIL released)."""
        self.verify(row, crc32c(data))


def join(segments: list[tuple[int, int, int]]) -> int:
    """The CRC-32C of a tensor from its segments ``(offset in the tensor, bytes, crc)`` in
    any order (they must cover it once)."""
    crc = 0
    for _, n, c in sorted(segments):
        crc = combine(crc, c, n)
    return crc
