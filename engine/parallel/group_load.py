"""A group of ranks loads a checkpoint once: each rank reads a share of its bytes, then sends it.

Every rank of a ``torch.distributed`` process group calls :func:`load` with the same source
(a local file, index or folder, or an ``http(s)://``/``s3://`` URL with the remote options).
Each rank reads the headers, lays every tensor out in one owned host block in the same order
(file order, shard after shard), and cuts the block into ``world_size`` spans of equal bytes
(a tensor may be split between two ranks).  Each rank reads only its span from the files or
the server, straight into its block, and verifies the checksums of the tensors it read whole;
then every span is sent to the others with ``broadcast`` in buckets of :data:`BUCKET_BYTES`
(one collective per bucket, not per tensor).  Every rank returns every tensor, byte-equal to
the file: the group reads each byte of the checkpoint once, not once per rank.

The ranks agree before anything is exchanged: one ``all_reduce`` after the files are opened
(a flag for a rank that failed, and a fingerprint of each rank's layout: ranks given different
checkpoints all fail), one after the reads.  A failure on any rank fails the load on every
rank; no rank waits for a span that will never come, and none returns a mix of two files.

Copies of tensor bytes: 1 on the rank that reads a byte (page cache or socket -> its block), 1
on every other rank (the collective's receive into its block).  Host destinations over
``gloo`` for now; each rank's reads finish before the exchange starts.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from engine.base._files import is_url
from engine.errors import ReadError, SafetensorError
from engine.format.checksums import Checks, verification, verifying

__all__ = ["load", "BUCKET_BYTES", "spans"]

#: bytes per broadcast: large enough that a collective's fixed cost is paid per tens of MiB
BUCKET_BYTES = 64 << 20
#: each tensor's offset in the block (as an owned load's: any dtype's alignment)
_ALIGN = 64
#: the most bytes of one read of a rank's span (a request within its deadline; the reads of a
#: span run on several threads)
_CHUNK = 16 << 20


def spans(total: int, world: int) -> list[tuple[int, int]]:
    """``world`` spans ``[lo, hi)`` of equal bytes (to one byte) covering ``[0, total)``."""
    return [(total * k // world, total * (k + 1) // world) for k in range(world)]


@contextlib.contextmanager
def _parts(source, remote: Mapping[str, Any], max_header_size: int) -> Iterator[list]:
    """The source's files as :class:`engine.loading.loader.Part` (all rows, in file order)."""
    from engine.loading.loader import Part

    spath = os.fspath(source)
    if is_url(spath):
        from engine.urls.remote_load import open_parts

        with open_parts(spath, max_header_size=max_header_size, **remote) as opened:
            yield [p._replace(rows=p.header.table.file_order()) for p in opened.ranged().parts]
        return
    if remote:
        raise TypeError(f"load_file() got options for a URL with a local path: {sorted(remote)}")
    from engine.base._files import open_regular
    from engine.checkpoints.checkpoint_info import open_layout
    from engine.format.header import read_header_fd

    layout, _, _ = open_layout(spath, max_header_size)
    fds: list[int] = []
    try:
        parts = []
        for shard in layout.files:
            path = os.path.join(layout.directory, shard)
            fd = open_regular(path)
            fds.append(fd)
            header = read_header_fd(fd, path=path, file_size=os.fstat(fd).st_size, max_header_size=max_header_size)
            parts.append(Part(fd, header, header.table.file_order(), path))
        yield parts
    finally:
        for fd in fds:
            os.close(fd)


def load(source, process_group, *, framework: str = "pt", verify_checksums: bool | None = None,
         max_header_size: int | None = None, bucket_bytes: int = BUCKET_BYTES, chunk_bytes: int | None = None,
         **remote) -> dict:
    """Every tensor of ``source`` as owned CPU tensors (``framework`` ``"pt"``: torch, ``"numpy"``:
    arrays, each over its range of one block) on every rank of ``process_group``, each byte read
    by one rank (see the module's doc).  ``remote``: the options of a URL's load (``headers``,
    ``timeout``, ``retry``, ``connections``, ...; ``cache_dir`` is refused: each rank would write a
    share of each copy); ``chunk_bytes``: the most bytes of one read (default 16 MiB).

    Raises what a load raises (on every rank, where any rank's open or read failed: the others
    raise ``ReadError`` with ``reason="GroupReadFailed"``); ``ReadError`` with
    ``reason="GroupMismatch"`` on every rank where the ranks read different checkpoints (another
    layout of names, dtypes, shapes or offsets); :class:`~engine.errors.SafetensorError` for
    tensor names that two files both hold.
    """
    import torch
    import torch.distributed as dist

    from engine.format.checksums import canonical_digest, verify_received
    from engine.format.header import MAX_HEADER_SIZE
    from engine.io.reader import map_threads, pread_into
    from engine.sinks import get_sink
    from engine.sinks._host import host_block

    if "cache_dir" in remote:
        raise TypeError("process_group= takes no cache_dir: each rank reads a share of every file")
    group = process_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    step = max(1, chunk_bytes or _CHUNK)

    def agree(failed: BaseException | None, fingerprint: int = 0) -> None:
        """Every rank learns whether any failed, and whether all saw the same checkpoint (one
        all_reduce: no rank goes on to a collective that another will never reach)."""
        status = torch.tensor([int(failed is not None), fingerprint, -fingerprint], dtype=torch.int64)
        with _peers(source):
            dist.all_reduce(status, op=dist.ReduceOp.MAX, group=group)
        if failed is not None:
            raise failed
        if int(status[0]):
            raise ReadError("another rank of the process group failed to read its share of the checkpoint",
                            reason="GroupReadFailed", path=os.fspath(source))
        if int(status[1]) != -int(status[2]):
            raise ReadError("the ranks of the process group read different checkpoints (names, dtypes, shapes "
                            "or offsets differ): give every rank the same source", reason="GroupMismatch",
                            path=os.fspath(source))

    with contextlib.ExitStack() as stack:
        stack.enter_context(verification(verify_checksums))
        try:
            parts = stack.enter_context(_parts(source, remote, max_header_size or MAX_HEADER_SIZE))
            layout = _layout(parts)
            total = layout[-1][3] + -(-layout[-1][4] // _ALIGN) * _ALIGN if layout else 0
            fingerprint = canonical_digest([n for _, _, n, _, _ in layout],
                                           [int(parts[i].header.table.codes[r]) for i, r, _, _, _ in layout],
                                           [parts[i].header.table.shapes[r] for i, r, _, _, _ in layout],
                                           [off for _, _, _, off, _ in layout], [n for *_, n in layout], None)
            block = host_block(total)
        except Exception as exc:  # every rank hears of it before any exchange
            agree(exc)
        agree(None, (fingerprint << 20) ^ total)
        flat = np.frombuffer(block, np.uint8) if total else np.zeros(1, np.uint8)
        view = memoryview(flat)
        lo, hi = spans(total, world)[rank]
        mine = []  # (part, file offset, block offset, bytes): my span's reads, at most ``step`` bytes each
        whole = []  # (part, row, block offset, bytes): the tensors I read whole
        for i, r, _, off, n in layout:
            a, b = max(lo, off), min(hi, off + n)
            if a >= b:
                continue
            p = parts[i]
            begin = p.header.data_start + int(p.header.table.begins[r])
            for c in range(a, b, step):
                mine.append((i, begin + (c - off), c, min(step, b - c)))
            if a == off and b == off + n:
                whole.append((i, r, off, n))

        def read(piece, fresh: bool = False) -> None:
            i, offset, a, n = piece
            p = parts[i]
            if p.ranges is not None:
                (getattr(p.ranges, "fresh", p.ranges) if fresh else p.ranges)(offset, [view[a : a + n]])
            else:
                pread_into(p.fd, offset, [view[a : a + n]], path=p.path)

        failed = None
        try:
            connections = remote.get("connections") or 8
            map_threads(read, mine, max(1, min(connections, len(mine))), name="engine-group")
            if verifying():  # the tensors read whole, checked by the rank that read them (read again
                for i, r, off, n in whole:  # from a server on a mismatch, as every remote load does)
                    verify_received(Checks.of(parts[i].header, parts[i].path), r, view[off : off + n],
                                    functools.partial(_again, read, mine, i, off, n))
        except Exception as exc:  # every rank hears of it before the exchange
            failed = exc
        agree(failed)
        with _peers(source):
            for k, (a, b) in enumerate(spans(total, world)):
                src = dist.get_global_rank(group, k) if group is not None else k
                while a < b:
                    size = min(bucket_bytes, b - a)
                    dist.broadcast(torch.from_numpy(flat[a : a + size]), src=src, group=group)
                    a += size
        if verifying():  # the tensors split between ranks: checked whole, on every rank (a few)
            cuts = [a for a, _ in spans(total, world)[1:]]
            for i, r, _, off, n in layout:
                if n and any(off < c < off + n for c in cuts):
                    checks = Checks.of(parts[i].header, parts[i].path)
                    if checks is not None:
                        checks.verify_bytes(r, view[off : off + n])
        sink = get_sink(framework)
        out = {}
        for i, r, name, off, n in layout:
            t = parts[i].header.table
            out[name] = sink.view(block, int(t.codes[r]), t.shapes[r], off, n)
        return out


@contextlib.contextmanager
def _peers(source) -> Iterator[None]:
    """A collective that fails because a rank of the group died or left (the backend's error,
    when its connection closes) as :class:`~engine.errors.ReadError` naming the source."""
    try:
        yield
    except RuntimeError as exc:  # torch's DistBackendError and gloo's errors are RuntimeErrors
        raise ReadError(f"a rank of the process group failed or left during the load: {exc}",
                        reason="GroupFailed", path=os.fspath(source)) from exc


def _layout(parts) -> list[tuple[int, int, str, int, int]]:
    """``(part, row, name, block offset, bytes)`` of every tensor, in file order, each at an
    offset aligned to :data:`_ALIGN`; a name in two files is an error."""
    layout = []
    at = 0
    seen: dict[str, str | None] = {}
    for i, p in enumerate(parts):
        t = p.header.table
        for r in p.rows:
            name = t.names[r]
            if name in seen:
                raise SafetensorError(f"tensor {name!r} is in two files: {seen[name]} and {p.path}",
                                      reason="DuplicateTensor", path=p.path, tensors=(name,))
            seen[name] = p.path
            n = int(t.ends[r]) - int(t.begins[r])
            layout.append((i, r, name, at, n))
            at += -(-n // _ALIGN) * _ALIGN
    return layout


def _again(read, mine, i: int, off: int, n: int) -> None:
    """Read the pieces of the tensor at ``[off, off + n)`` of the block (file ``i``) again,
    from the server where it is remote (not from what a stream kept)."""
    for m in mine:
        if m[0] == i and off <= m[2] < off + n:
            read(m, fresh=True)
