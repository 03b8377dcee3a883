"""A group of ranks loads a checkpoint once: each rank reads a share of its bytes and sends it.

Every rank of a ``torch.distributed`` process group calls :func:`load` (or :func:`stream`,
:func:`load_into`) with the same source: a local file, index or folder, or an
``http(s)://``/``s3://`` URL with the remote options.  Each rank reads the headers, lays every
tensor out in one owned host block in the same order (file order, shard after shard), and
cuts the block into ``world_size`` spans of equal bytes (a tensor may be split between two
ranks).  Each rank reads only its span, from the files or the server, straight into its block.

The exchange is pipelined in rounds: each span is cut into buckets of :data:`BUCKET_BYTES`,
and round ``j`` sends bucket ``j`` of every span with ``broadcast`` (one collective per bucket,
not per tensor) while the readers go on with the next buckets.  Before each round the ranks
agree (one small ``all_reduce``) that every bucket of the round landed and the tensors that lie
in one bucket passed their checksums on the rank that read them; a tensor in several buckets
(or split between ranks) is checked on every rank once its last bucket came, and read again by
its owners and sent again on a mismatch of bytes from a server.  Every rank ends with every tensor, byte-equal to the
file: the group reads each byte of the checkpoint once, not once per rank.

The ranks also agree before anything is read: a flag for a rank that failed to open its
source, and a fingerprint of each rank's layout and options (ranks given different
checkpoints, or a different bucket size, all fail at once).  A failure on any rank fails the
load on every rank with :class:`~engine.errors.DistributedLoadError` naming the rank and the
cause; no rank waits in a collective for bytes that will never come, and none returns a mix
of two files.  Every rank must go on calling until the load ends (a stream consumed to its
end), as with any collective.

Copies of tensor bytes: 1 on the rank that reads a byte (page cache or socket -> its block), 1
on every other rank (the collective's receive into its block); :func:`load_into` adds one
(block -> the destination, host or CUDA).  Host blocks over ``gloo``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from engine.base._files import is_url
from engine.errors import DistributedLoadError, SafetensorError, TensorNotFoundError
from engine.format.checksums import Checks, verification, verifying

__all__ = ["load", "stream", "load_into", "BUCKET_BYTES", "spans"]

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
def _parts(source, remote: Mapping[str, Any], max_header_size: int) -> Iterator[tuple[list, Any]]:
    """The source's files as :class:`engine.loading.loader.Part` (all rows, in file order), and
    what to call once the load succeeded (a URL's ``cache_dir`` copies are linked into place)."""
    from engine.loading.loader import Part

    spath = os.fspath(source)
    if is_url(spath):
        from engine.urls.remote_load import open_parts

        with open_parts(spath, max_header_size=max_header_size, **remote) as opened:
            ranged = opened.ranged()
            yield [p._replace(rows=p.header.table.file_order()) for p in ranged.parts], ranged.commit
        return
    from engine.base._files import open_regular
    from engine.checkpoints.checkpoint_info import missing_shard, open_layout
    from engine.format.header import read_header_fd

    layout, _, _ = open_layout(spath, max_header_size)
    fds: list[int] = []
    try:
        parts = []
        for shard in layout.files:
            path = os.path.join(layout.directory, shard)
            try:
                fd = open_regular(path)
            except FileNotFoundError as exc:
                if layout.index_path:  # a shard the index names, not there
                    raise missing_shard(shard, layout, exc) from exc
                raise
            fds.append(fd)
            header = read_header_fd(fd, path=path, file_size=os.fstat(fd).st_size, max_header_size=max_header_size)
            parts.append(Part(fd, header, header.table.file_order(), path))
        yield parts, lambda: None
    finally:
        for fd in fds:
            os.close(fd)


def load(source, process_group, *, framework: str = "pt", **options) -> dict:
    """Every tensor of ``source`` as owned CPU tensors (``framework`` ``"pt"``: torch,
    ``"numpy"``: arrays, each over its range of one block) on every rank of ``process_group``,
    each byte read by one rank (see the module's doc).

    Parameters
    ----------
    source : str or os.PathLike
        The same on every rank: a file, an index, a folder or a URL.
    process_group : torch.distributed.ProcessGroup
        ``gloo`` (host tensors); ``torch.distributed.group.WORLD`` or a sub-group.
    framework : {"pt", "numpy"}
    verify_checksums : bool, optional
        Check the CRC-32C the files record (default True): a tensor in one bucket on the rank
        that read it, before it is sent; a tensor in several buckets on every rank once it
        came.  A remote tensor that fails is read again from the server (and sent again).
    bucket_bytes : int, optional
        Bytes per broadcast (default :data:`BUCKET_BYTES`); the same on every rank.
    chunk_bytes : int, optional
        The most bytes of one read (default 16 MiB).
    max_header_size : int, optional
    **remote
        A URL's options (``headers``, ``timeout``, ``retry``, ``connections``, ``cache_dir``,
        ...).  With ``cache_dir``, a rank that has a current copy of a file reads its span from
        the copy, and a rank that has none writes one: the bytes it read and those it received,
        a complete copy once the load succeeded.  Ranks of one machine that share a directory
        should pass it on one of them (each rank that passes it writes the whole copy).

    Raises
    ------
    DistributedLoadError
        On every rank, when any rank's open, read or check failed (``.rank``: the first rank
        that failed, ``.cause``: its error in words; ``reason="GroupReadFailed"``), when the
        ranks read different checkpoints or gave different options (``"GroupMismatch"``), or
        when a rank died or left during the load (``"GroupFailed"``).
    SafetensorError
        For tensor names that two files both hold (on every rank).
    """
    return dict(stream(source, process_group, framework=framework, **options))


def stream(source, process_group, *, framework: str = "pt", verify_checksums: bool | None = None,
           max_header_size: int | None = None, bucket_bytes: int = BUCKET_BYTES, chunk_bytes: int | None = None,
           stats: bool = False, quantize=None, _wanted=None, _select=None, _release: bool = False, _meta=None,
           **remote) -> Iterator[tuple]:
    """Yield ``(name, tensor)`` on every rank of ``process_group`` as each tensor's last bucket
    lands (a round of the exchange); options, errors and copies as :func:`load`.  Every rank
    must consume the stream to its end.  The tensors are views of one host block of the
    checkpoint's size, held while any of them is.

    ``stats=True`` yields ``(name, tensor, Stats)`` (``None`` for dtypes the kernels do not
    summarise) and ``quantize`` (``"int8"`` or :class:`engine.quantize.Int8`) yields the tensors
    it selects as :class:`~engine.quantize.QuantizedTensor`, as :func:`engine.stream` does: both
    computed on every rank from its landed bytes (a pass over each tensor, needs Numba).

    For the engine's own callers: ``_select`` (a predicate of names) loads only those tensors
    (the same on every rank); with ``_release`` the caller keeps nothing it was handed past the
    next step of the stream, and each tensor's pages go back to the system once it is
    consumed (a tensor-parallel rank keeps its shards, not the block); ``_meta``, a dict, gets
    ``name -> (format dtype, shape)`` of every tensor before the first is yielded."""
    _check_options(source, remote)
    with verification(verify_checksums):
        group = _Group(source, process_group, framework, max_header_size, bucket_bytes, chunk_bytes, _wanted, remote)
        group.select, group.release, group.quantize, group.meta = _select, _release, quantize, _meta
        for name, tensor in group:
            yield _hooked(name, tensor, group.meta[name][0], stats, group.spec, group.source) \
                if stats or group.spec is not None else (name, tensor)


def _check_options(source, remote: Mapping[str, Any]) -> None:
    """A ``TypeError`` on every rank, before any collective, for options a group load does
    not take (the same options reach every rank, so every rank raises)."""
    if not is_url(os.fspath(source)):
        if remote:
            raise TypeError(f"a group load of a local path got options it does not take: {sorted(remote)}")
        return
    from engine.urls.remote_load import remote_options

    left = dict(remote)
    remote_options(left)
    if left:
        raise TypeError(f"a group load of a URL got options it does not take: {sorted(left)}")


def load_into(source, tensors: Mapping[str, Any], process_group, *, strict: bool = False, **options) -> list[str]:
    """Fill existing tensors (host or CUDA; numpy, torch or CuPy) in place on every rank of
    ``process_group``, each byte of ``source`` read by one rank; options and errors as
    :func:`load`, and as :func:`engine.load_into` for the destinations (checked on every rank
    before anything is read: a wrong one fails every rank; a failure's ``.filled`` names the
    destinations whose bytes all landed).

    Returns the names filled, in file order.  Copies of tensor bytes: 2 on every rank (the read
    or the collective's receive into a host block, then block -> destination as each tensor's
    last bucket lands); the block is freed when the load returns.
    """
    filled: list[str] = []
    meta: dict[str, Any] = {}
    wanted: tuple[dict, bool, dict] = (dict(tensors), strict, {})  # the destinations, strict, and their fill targets once checked
    try:
        for name, data in stream(source, process_group, framework="raw", _wanted=wanted, _meta=meta, **options):
            target = wanted[2].get(name)
            if target is None:
                continue
            if not len(data):
                pass
            elif target.device is None:
                np.frombuffer(target.host_bytes(), np.uint8)[:] = data
            elif hasattr(dst := target.device_bytes(), "copy_"):  # torch CUDA
                import torch

                dst.copy_(torch.from_numpy(data))
            else:  # CuPy
                dst.set(data)
            filled.append(name)
    except SafetensorError as err:
        err.filled = sorted(filled)  # type: ignore[attr-defined]
        raise
    order = {name: k for k, name in enumerate(meta)}  # file order
    return sorted(filled, key=order.__getitem__)


class _Group:
    """One group load: open, agree, read in buckets, exchange round by round, yield."""

    def __init__(self, source, group, framework, max_header_size, bucket_bytes, chunk_bytes, wanted, remote) -> None:
        import torch.distributed as dist

        self.wanted = wanted  # load_into's (destinations, strict, targets filled here)
        self.source, self.group, self.framework, self.remote = os.fspath(source), group, framework, remote
        self.max_header_size, self.bucket = max_header_size, max(1, int(bucket_bytes))
        self.step = max(1, chunk_bytes or _CHUNK)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.select, self.release, self.quantize = None, False, None
        self.spec = None  # the quantize spec, checked with the rest before any exchange
        self.verify = True  # whether this load checks checksums (read once, when it starts)
        self.checks_of: list = []  # each file's Checks, or None
        self.meta: dict[str, tuple[str, tuple]] = {}  # name -> (format dtype, shape), file order

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        from engine.format.header import MAX_HEADER_SIZE

        self.verify = verifying()  # read once: every round of every rank checks the same way
        with contextlib.ExitStack() as stack:
            try:  # everything that can fail on one rank alone, before the first collective
                parts, commit = stack.enter_context(
                    _parts(self.source, self.remote, self.max_header_size or MAX_HEADER_SIZE))
                if self.select is not None:
                    parts = [p._replace(rows=[r for r in p.rows if self.select(p.header.table.names[r])]) for p in parts]
                layout = _layout(parts)
                from engine.base import dtypes

                if self.meta is None:
                    self.meta = {}
                for i, r, name, _, _ in layout:
                    table = parts[i].header.table
                    self.meta[name] = (dtypes.NAMES[int(table.codes[r])], tuple(table.shapes[r]))
                if self.wanted is not None:
                    from engine.sinks import fill_target

                    self.wanted[2].update({name: fill_target(dst) for name, dst in self.wanted[0].items()})
                    _check_destinations(parts, layout, self.wanted[2], self.wanted[1], self.source)
                if self.quantize is not None:
                    from engine.numerics.quantize import Int8

                    self.spec = Int8.of(self.quantize)
                # each file's checks, looked up once (None: no checksums, or not checking); a header
                # that fails its own checksum, and an empty tensor's wrong one, fail here
                self.checks_of = [Checks.of(p.header, p.path) if self.verify else None for p in parts]
                if self.verify:
                    for i, r, _, _, n in layout:
                        checks = self.checks_of[i]
                        if checks is not None and not n:
                            checks.verify_bytes(r, b"")
                total = layout[-1][3] + -(-layout[-1][4] // _ALIGN) * _ALIGN if layout else 0
                fingerprint = self._fingerprint(parts, layout, total)
                from engine.sinks._host import host_block

                block = host_block(total)
            except Exception as exc:  # every rank hears of it before any exchange
                self._agree(exc)
                raise  # (not reached: _agree raised)
            self._agree(None, fingerprint)
            pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(
                max(1, min(self.remote.get("connections") or 8, 64)), thread_name_prefix="engine-group"))
            stack.callback(pool.shutdown, wait=True, cancel_futures=True)  # a failed round stops the reads
            yield from self._rounds(parts, layout, total, block, pool)
            commit()

    def _fingerprint(self, parts, layout, total: int) -> int:
        """63 bits of the layout (names, dtypes, shapes, offsets) and of the options every rank
        must share (a different bucket size would pair different collectives)."""
        from engine.format.checksums import canonical_digest

        digest = canonical_digest([n for _, _, n, _, _ in layout],
                                  [int(parts[i].header.table.codes[r]) for i, r, _, _, _ in layout],
                                  [parts[i].header.table.shapes[r] for i, r, _, _, _ in layout],
                                  [off for _, _, _, off, _ in layout], [n for *_, n in layout], None)
        from engine.format.checksums import KEY

        # the checksum entries too: ranks that check different things would run different collectives
        entries = hashlib.blake2b("|".join(str((p.header.metadata or {}).get(KEY)) for p in parts).encode()).hexdigest()
        text = f"{digest}:{total}:{self.bucket}:{self.verify}:{self.wanted is not None}:{self.release}:{entries}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")

    def _agree(self, failed: BaseException | None, fingerprint: int = 0) -> None:
        """Every rank learns whether any failed (and then which, and why), and whether all saw
        the same checkpoint: no rank goes on to a collective that another will never reach."""
        import torch
        import torch.distributed as dist

        status = torch.tensor([int(failed is not None), fingerprint, -fingerprint], dtype=torch.int64)
        with _peers(self.source):
            dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.group)
        if int(status[0]):
            causes: list[str | None] = [None] * self.world
            mine = None if failed is None else f"{type(failed).__name__}: {failed}"
            with _peers(self.source):
                dist.all_gather_object(causes, mine, group=self.group)
            who = next(k for k, c in enumerate(causes) if c is not None)
            raise DistributedLoadError(f"rank {who} of the process group failed: {causes[who]}", rank=who,
                                       cause=causes[who], reason="GroupReadFailed", path=self.source) from failed
        if int(status[1]) != -int(status[2]):
            raise DistributedLoadError("the ranks of the process group were given different checkpoints or options "
                                       "(names, dtypes, shapes, offsets, bucket_bytes, verify_checksums or load_into "
                                       "differ): give every rank the same", reason="GroupMismatch", path=self.source)

    def _src(self, k: int) -> int:
        """The global rank of the group's rank ``k`` (what ``broadcast`` takes)."""
        import torch.distributed as dist

        return dist.get_global_rank(self.group, k) if self.group is not None else k

    def _rounds(self, parts, layout, total: int, block, pool) -> Iterator[tuple[str, Any]]:
        import torch
        import torch.distributed as dist

        flat = np.frombuffer(block, np.uint8) if total else np.zeros(1, np.uint8)
        view = memoryview(flat)
        cuts = spans(total, self.world)
        lo, hi = cuts[self.rank]
        bucket = self.bucket
        rounds = max((-(-(b - a) // bucket) for a, b in cuts), default=0)
        pieces: list[tuple[int, int, int, int]] = []  # my reads: (part, file offset, block offset, bytes)
        by_round: list[list[int]] = [[] for _ in range(rounds)]  # my pieces, by the round that sends them
        # tensors in one bucket of mine, checked (and read again) before that bucket is sent
        whole: list[list[tuple[int, int, int, int, list[int]]]] = [[] for _ in range(rounds)]
        # tensors in several buckets or split between ranks, checked on every rank once their last
        # bucket came (checking them before their first bucket is sent would hold the rounds back)
        split: list[list[tuple[int, int, int, int, list]]] = [[] for _ in range(rounds)]
        ready: list[list[int]] = [[] for _ in range(max(rounds, 1))]  # tensors complete after each round
        theirs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(rounds)]  # received, for cache_dir
        keeps: list[Any] = [getattr(p.ranges, "keep", None) for p in parts]  # a URL's cache_dir copy
        for t, (i, r, _, off, n) in enumerate(layout):
            owners = [(k, max(a, off), min(b, off + n)) for k, (a, b) in enumerate(cuts) if max(a, off) < min(b, off + n)]
            last = max(((b - 1 - cuts[k][0]) // bucket for k, _, b in owners), default=0)
            ready[last].append(t)
            spread = len(owners) > 1 or any((a - cuts[k][0]) // bucket != (b - 1 - cuts[k][0]) // bucket
                                            for k, a, b in owners)
            if spread:
                split[last].append((i, r, off, n, owners))
            begin = parts[i].header.data_start + int(parts[i].header.table.begins[r])
            for k, a, b in owners:
                if k != self.rank:
                    while keeps[i] and a < b:  # the bytes other ranks read, for this rank's local copy
                        j = (a - cuts[k][0]) // bucket
                        e = min(b, cuts[k][0] + (j + 1) * bucket)
                        theirs[j].append((i, begin + (a - off), a, e - a))
                        a = e
                    continue
                first, mine = (a - lo) // bucket, []
                whole_tensor = (a, b) == (off, off + n)
                while a < b:  # pieces of at most ``step`` bytes, none across a bucket's end
                    j = (a - lo) // bucket
                    e = min(b, a + self.step, lo + (j + 1) * bucket)
                    by_round[j].append(len(pieces))
                    mine.append(len(pieces))
                    pieces.append((i, begin + (a - off), a, e - a))
                    a = e
                if whole_tensor and not spread:
                    whole[first].append((i, r, off, n, mine))

        def read(piece, fresh: bool = False) -> None:
            i, offset, a, n = piece
            p = parts[i]
            if p.ranges is not None:
                (getattr(p.ranges, "fresh", p.ranges) if fresh else p.ranges)(offset, [view[a : a + n]])
            else:
                from engine.io.reader import pread_into

                pread_into(p.fd, offset, [view[a : a + n]], path=p.path)

        futures = [pool.submit(read, piece) for piece in pieces]  # in order: the buckets land in order
        from engine.format.checksums import verify_received
        from engine.sinks import get_sink

        sink = get_sink(self.framework) if self.framework != "raw" else None
        for j in range(max(rounds, 1)):
            if rounds:
                failed = None
                try:
                    for x in by_round[j]:
                        futures[x].result()
                    if self.verify:  # read again from a server on a mismatch, before anything of it is sent
                        for i, r, off, n, mine in whole[j]:
                            checks = self.checks_of[i]
                            if parts[i].ranges is None:  # a local file: its bytes are what they are
                                if checks is not None:
                                    checks.verify_bytes(r, view[off : off + n])
                                continue
                            def again(mine: list[int] = mine) -> None:  # from the server, not a kept stream
                                for x in mine:
                                    read(pieces[x], fresh=True)

                            verify_received(checks, r, view[off : off + n], again)
                except Exception as exc:  # every rank hears of it before the round's collectives
                    failed = exc
                self._agree(failed)
                with _peers(self.source):
                    for k, (a, b) in enumerate(cuts):
                        a += j * bucket
                        if a < b:
                            dist.broadcast(torch.from_numpy(flat[a : min(b, a + bucket)]), src=self._src(k),
                                           group=self.group)
                for i, offset, a, n in theirs[j]:
                    keeps[i](offset, [view[a : a + n]])
                if self.verify:
                    for item in split[j]:
                        self._verify_split(item, parts, flat, read, keeps)
            for t in ready[j]:
                i, r, name, off, n = layout[t]
                if sink is None:
                    yield name, flat[off : off + n]
                else:
                    table = parts[i].header.table
                    yield name, sink.view(block, int(table.codes[r]), table.shapes[r], off, n)
                if self.release:
                    _release(block, off, n)

    def _verify_split(self, item, parts, flat, read, keeps) -> None:
        """Check a tensor sent in several buckets (by one rank or several), on every rank (the
        same bytes everywhere, so the same verdict).  A mismatch of bytes from a server: each
        owner reads its part again and sends it again, until the checksum passes or two reads
        agree; then every rank raises."""
        import torch
        import torch.distributed as dist

        from engine.errors import ChecksumError
        from engine.format.checksums import crc32c, read_again, read_until_agreed

        i, r, off, n, owners = item
        checks = self.checks_of[i]
        if checks is None:
            return
        first = crc32c(flat[off : off + n])
        try:
            checks.verify(r, first)
            return
        except ChecksumError as exc:
            err = exc
        begin = parts[i].header.data_start + int(parts[i].header.table.begins[r])

        def again() -> int:
            failed = None
            try:
                for k, a, b in owners:
                    for c in range(a, b, self.step) if k == self.rank else ():
                        read((i, begin + (c - off), c, min(self.step, b - c)), fresh=True)
            except Exception as exc:
                failed = exc
            self._agree(failed)
            with _peers(self.source):
                for k, a, b in owners:
                    dist.broadcast(torch.from_numpy(flat[a:b]), src=self._src(k), group=self.group)
                    if k != self.rank and keeps[i]:
                        keeps[i](begin + (a - off), [memoryview(flat[a:b])], again=True)
            return crc32c(flat[off : off + n])

        if parts[i].ranges is not None:
            crc, agreed = read_until_agreed(first, int(checks.expected[r]), again)
            if crc == int(checks.expected[r]):
                return
            err = read_again(err, crc, agreed)
        who = ", ".join(str(k) for k, _, _ in owners)
        raise DistributedLoadError(f"a tensor read by rank(s) {who} failed its checksum on every rank: {err}",
                                   rank=owners[0][0] if len(owners) == 1 else None, cause=f"ChecksumError: {err}",
                                   reason="GroupReadFailed", path=self.source, tensors=err.tensors) from err


def _hooked(name: str, tensor, kind: str, stats: bool, spec, where: str) -> tuple:
    """``(name, tensor or its QuantizedTensor[, Stats])`` as :func:`engine.stream` yields them."""
    out = tensor
    if spec is not None:
        chosen, axis = spec.select(name, kind, tuple(tensor.shape), where)
        if chosen:
            from engine.numerics.quantize import QuantizedTensor, quantize_int8

            q, scale = quantize_int8(tensor, axis=axis, name=name)
            out = QuantizedTensor(q, scale, axis, kind)
    if not stats:
        return name, out
    from engine.numerics.statistics import SUPPORTED_NAMES
    from engine.numerics.statistics import stats as summarise

    return name, out, summarise(tensor) if kind in SUPPORTED_NAMES else None


def _release(block, off: int, n: int) -> None:
    """Give the whole pages of ``[off, off + n)`` of the block back to the system (they read as
    zeros afterwards); the pages it shares with its neighbours stay."""
    import mmap

    page = mmap.PAGESIZE
    a, b = -(-off // page) * page, (off + n) // page * page
    if b > a and hasattr(mmap, "MADV_DONTNEED"):
        block.madvise(mmap.MADV_DONTNEED, a, b - a)


def _check_destinations(parts, layout, targets: Mapping[str, Any], strict: bool, where: str) -> None:
    """:func:`load_into`'s checks, before anything is read: every destination named in the
    checkpoint, of its tensor's dtype and shape, in memory a load can fill (and, with
    ``strict``, every tensor named)."""
    from engine.errors import DeviceError
    from engine.loading.fill import check_destination

    rows = {name: (i, r) for i, r, name, _, _ in layout}
    missing = [n for n in targets if n not in rows]
    if missing:
        raise TensorNotFoundError(f"{len(missing)} destination tensor(s) not in the file: {missing[:5]}",
                                  path=where, tensors=missing)
    extra = [n for n in rows if n not in targets]
    if strict and extra:
        raise TensorNotFoundError(f"{len(extra)} tensor(s) of the file have no destination: {extra[:5]}",
                                  path=where, tensors=extra)
    for name, target in targets.items():
        i, r = rows[name]
        if target.device is not None and target.device_ops() is None:
            raise DeviceError(f"tensor {name!r}: load_into fills CPU or CUDA memory, and the destination is on "
                              f"{target.where!r}", reason="UnsupportedDevice", path=parts[i].path, tensors=(name,))
        check_destination(target, parts[i].header.table, r, parts[i].path)


@contextlib.contextmanager
def _peers(source) -> Iterator[None]:
    """A collective that fails because a rank of the group died or left (the backend's error,
    when its connection closes) as :class:`~engine.errors.DistributedLoadError` naming the source."""
    try:
        yield
    except RuntimeError as exc:  # torch's DistBackendError and gloo's errors are RuntimeErrors
        raise DistributedLoadError(f"a rank of the process group failed or left during the load: {exc}",
                                   cause=str(exc), reason="GroupFailed", path=os.fspath(source)) from exc


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

