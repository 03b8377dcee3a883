"""A group of ranks loads a checkpoint once: each rank reads a share of its bytes and sends it.

Every rank of a ``torch.distributed`` process group calls :func:`load` (or :func:`stream`,
:func:`load_into`) with the same source: a local file, index or folder, or an
``http(s)://``/``s3://`` URL with the remote options.  Each rank reads the headers and lays
every tensor out in the same order (file order, shard after shard).  The layout is cut into
rounds of whole tensors (at most ``bucket_bytes`` each, or one larger tensor alone), and each
round into a share of equal bytes per reader (a tensor may lie in two shares).  Each reader
reads only its share of each round, from the files or the server, and round ``j`` is sent
with one ``broadcast`` per share while the readers go on with the next rounds.

Who reads for whom (``reads=``): by default each machine's ranks (found by host name) read the
checkpoint once between them and send it over a gloo group of their own, so no tensor byte
crosses between machines; ``reads="group"`` has the whole group read it once.  A rank whose
source does not exist (a machine without the files) is no reader: it takes the headers from the
first rank that has a copy and receives every byte; where no rank of a machine has one, the
whole group's readers serve it.  A copy that is there but lacks a shard fails every rank.

The rounds land in host memory bounded by the caller's need, not by the checkpoint: an owned
load (:func:`load`) reads into its output, one block of the checkpoint's size; a stream gives
each round a block of its own that lives as long as a tensor handed out of it; ``load_into``
(and tensor parallelism) reuse as many blocks as rounds are in flight.  Two rounds are in
flight by default; ``memory_limit=`` (:mod:`engine.planning.memory`) sizes the rounds and the
window from a budget of bytes (``0``: the largest tensor, one round at a time).  The ranks
agree on the smallest round any of them asked for.

Before each round the ranks agree (one small ``all_reduce``) that every share of the round
landed and the tensors that lie in one share passed their checksums on the rank that read
them; a tensor in two shares is checked on every rank once the round came, and read again by
its owners and sent again on a mismatch of bytes from a server.  Every rank ends with every
tensor, byte-equal to the file: the group reads each byte of the checkpoint once, not once
per rank.

The ranks also agree before anything is read: a flag for a rank that failed to open its
source, and a fingerprint of each rank's layout and options (ranks given different
checkpoints, or options that would pair different collectives, all fail at once).  A failure
on any rank fails the load on every rank with :class:`~engine.errors.DistributedLoadError`
naming the rank and the cause; no rank waits in a collective for bytes that will never come,
and none returns a mix of two files.  Every rank must go on calling until the load ends (a
stream consumed to its end), as with any collective.

Copies of tensor bytes: 1 on the rank that reads a byte (page cache or socket -> its round's
block), 1 on every other rank (the collective's receive into its block); :func:`load_into`
adds one (block -> the destination, host or CUDA).  Host blocks over ``gloo``: a group of
another backend (NCCL, whose collectives take CUDA tensors only) is served by a gloo group of
the same ranks, made once by its members, for the agreements and host payloads.  A
:func:`load_into` of CUDA tensors on an NCCL group (:data:`DEVICE_PAYLOADS`) sends its rounds
through device blocks instead (two per rank by default, of a round each): each reader copies
its share up and the shares are broadcast over NCCL (NVLink between a machine's GPUs), then
copied into the destinations on the device; tensors with checksums that lie in two shares come
back to the host to be checked.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import time
from collections.abc import Generator, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from engine.base._files import is_url
from engine.errors import DistributedLoadError, SafetensorError, TensorNotFoundError
from engine.format.checksums import Checks, verification, verifying
from engine.planning import memory

__all__ = ["load", "stream", "load_into", "BUCKET_BYTES", "spans"]

#: bytes of a round (each rank sends its share): large enough that a collective's fixed cost is
#: paid per MiBs, small enough that two rounds in flight stay a small part of a model
BUCKET_BYTES = 32 << 20
#: seconds one rank's reads of one round may take before every rank gives up on the load: a
#: read stuck on a hung network mount fails the group instead of leaving it waiting
READ_DEADLINE = 600.0
#: who reads for whom: ``"node"``, the ranks of each machine read the checkpoint once between
#: them and send it to each other (no bytes between machines); ``"group"``, the whole group
#: reads it once and every byte crosses to every machine
READS = ("node", "group")
#: seconds between two looks, while a rank waits for its reads, at a Ctrl-C taken meanwhile
_POLL = 0.25
#: each tensor's offset in the block (as an owned load's: any dtype's alignment)
_ALIGN = 64
#: the most bytes of one read of a rank's span (a request within its deadline; the reads of a
#: span run on several threads)
_CHUNK = 16 << 20


def spans(total: int, world: int) -> list[tuple[int, int]]:
    """``world`` spans ``[lo, hi)`` of equal bytes (to one byte) covering ``[0, total)``."""
    return [(total * k // world, total * (k + 1) // world) for k in range(world)]


@contextlib.contextmanager
def _parts(source, remote: Mapping[str, Any], max_header_size: int) -> Iterator[tuple[list, Any, str]]:
    """The source's files as :class:`engine.loading.loader.Part` (all rows, in file order), what
    to call once the load succeeded (a URL's ``cache_dir`` copies are linked into place), and
    what tells this rank's copy of the bytes from another revision with the same header (a
    URL's ETags; a local file's sampled bytes, :func:`_sampled`)."""
    from engine.loading.loader import Part

    spath = os.fspath(source)
    if is_url(spath):
        from engine.urls.remote_load import open_parts

        with open_parts(spath, max_header_size=max_header_size, **remote) as opened:
            ranged = opened.ranged()
            # which version of each file this rank was served: a push between two ranks' opens differs here
            etags = sorted(str(v) for v in getattr(opened.source, "etags", {}).values())
            yield [p._replace(rows=p.header.table.file_order()) for p in ranged.parts], ranged.commit, "|".join(etags)
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
        yield parts, lambda: None, _sampled(parts)
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
        ``torch.distributed.group.WORLD`` or a sub-group, of any backend: the load's
        collectives run on a gloo group of its ranks where it is not gloo's (host tensors).
    framework : {"pt", "numpy"}
    device : str, int or torch.device, default "cpu"
        Where the tensors go: the CPU (views of the rounds' host blocks, or an owned load's one
        block), or a CUDA device (``"pt"`` only, without ``stats`` or ``quantize``): each
        tensor its own allocation there, copied as its round lands; on an NCCL group the rounds
        travel between the GPUs over NCCL (device blocks), on gloo through host memory.
    verify_checksums : bool, optional
        Check the CRC-32C the files record (default True): a tensor in one bucket on the rank
        that read it, before it is sent; a tensor in several buckets on every rank once it
        came.  A remote tensor that fails is read again from the server (and sent again).
    reads : {"node", "group"}, optional
        ``"node"`` (default): the ranks of each machine read the checkpoint once between them
        and no tensor byte crosses between machines; ``"group"``: the whole group reads it
        once (storage slower than the links between machines).  The same on every rank.
    bucket_bytes : int, optional
        The most bytes of a round (default :data:`BUCKET_BYTES`; a larger tensor is a round
        of its own); the ranks use the smallest any of them gives.
    read_deadline : float or None, optional
        Seconds one rank's reads of one round may take (default :data:`READ_DEADLINE`; None:
        no deadline): past it every rank raises, naming that rank, instead of waiting on a
        stalled file system or server.
    memory_limit : int, optional
        Host bytes the load may hold beyond its outputs (:mod:`engine.planning.memory`): an
        owned load reads into its output and holds nothing more; :func:`stream` and
        :func:`load_into` size their rounds and the rounds in flight from it (``0``: the
        largest tensor, one round at a time).  Below the largest tensor, an
        :class:`~engine.errors.OptionError` naming both on every rank.
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
    return dict(stream(source, process_group, framework=framework, _staging="whole", **options))


def stream(source, process_group, *, framework: str = "pt", device: Any = "cpu", verify_checksums: bool | None = None,
           max_header_size: int | None = None, bucket_bytes: int = BUCKET_BYTES, chunk_bytes: int | None = None,
           stats: bool = False, quantize=None, memory_limit: int | None = None,
           read_deadline: float | None = READ_DEADLINE, reads: str = "node", _wanted=None, _select=None,
           _release: bool = False, _meta=None, _staging: str = "fresh", _device=None, **remote) -> Iterator[tuple]:
    """Yield ``(name, tensor)`` on every rank of ``process_group`` as each tensor's round of
    the exchange lands; options, errors and copies as :func:`load`.  Every rank must consume
    the stream to its end.  The tensors are views of one host block per round (of at most
    ``bucket_bytes``, or one larger tensor), held while any of them is: a consumer that keeps
    none holds at most the rounds in flight (two by default, see ``memory_limit``).

    ``stats=True`` yields ``(name, tensor, Stats)`` (``None`` for dtypes the kernels do not
    summarise) and ``quantize`` (``"int8"`` or :class:`engine.quantize.Int8`) yields the tensors
    it selects as :class:`~engine.quantize.QuantizedTensor`, as :func:`engine.stream` does: both
    computed on every rank from its landed bytes (a pass over each tensor, needs Numba).

    For the engine's own callers: ``_select`` (a predicate of names) loads only those tensors
    (the same on every rank); with ``_release`` the caller keeps nothing it was handed past the
    next step of the stream, so the rounds' blocks are reused (a tensor-parallel rank keeps its
    shards, not the block); ``_meta``, a dict, gets ``name -> (format dtype, shape)`` of every
    tensor before the first is yielded; ``_staging`` (:class:`_Group`) where the rounds land;
    ``_device`` (a ``torch.device``), where the caller puts the tensors: on a group whose backend
    moves that device's memory (:data:`DEVICE_PAYLOADS`) the rounds travel there and the tensors
    handed out are views of a device block (with ``_release``)."""
    to = _device_of(device)
    staging = "ring" if _release or _wanted is not None or to is not None else _staging
    with verification(verify_checksums):
        group = _Group(source, process_group, framework, max_header_size, bucket_bytes, chunk_bytes, _wanted, remote,
                       staging, memory_limit)
        group.select, group.quantize, group.meta, group.deadline = _select, quantize, _meta, read_deadline
        group.reads, group.on = reads, _device if to is None else to
        group.to, group.stats = to, stats
        for name, tensor in group:
            if to is not None:  # the tensor's own memory on the device, before the round's block is reused
                tensor = tensor.to(to) if tensor.device != to else tensor.clone()
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
    or the collective's receive into a round's host block, then block -> destination as each
    tensor's round lands); CUDA destinations on an NCCL group: 3 on a byte's reader (the read,
    its share up to a device block, the block -> destination), 2 on the others (NCCL's receive
    into the device block, the block -> destination).  The rounds' blocks are reused: host memory beyond the
    destinations is the rounds in flight (``memory_limit``), whatever the checkpoint's size.
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

                dst.copy_(data if isinstance(data, torch.Tensor) else torch.from_numpy(data))
            else:  # CuPy
                dst.set(data)
            filled.append(name)
    except SafetensorError as err:
        err.filled = sorted(filled)  # type: ignore[attr-defined]
        raise
    order = {name: k for k, name in enumerate(meta)}  # file order
    return sorted(filled, key=order.__getitem__)


class _Round(NamedTuple):
    """One round of the exchange: the block's bytes ``[lo, hi)``, tensors ``[first, end)`` of
    the layout, each rank's share of them, and this rank's part in it."""

    lo: int
    hi: int
    first: int
    end: int
    cuts: list[tuple[int, int]]  # each reader's share [a, b) of [lo, hi), in block offsets
    pieces: list[tuple[int, int, int, int]]  # this rank's reads: (part, file offset, block offset, bytes)
    whole: list[tuple[int, int, int, int, list[int]]]  # tensors all in this rank's share: checked before sending
    split: list[tuple[int, int, int, int, list]]  # tensors shared by ranks: checked on every rank after it
    theirs: list[tuple[int, int, int, int]]  # the bytes other ranks read, for this rank's cache_dir copy


def _cut(layout, round_bytes: int) -> list[tuple[int, int, int, int]]:
    """``(lo, hi, first, end)`` of each round: consecutive whole tensors of at most
    ``round_bytes`` from the first one's offset, or one larger tensor alone."""
    out = []
    t = 0
    while t < len(layout):
        lo = layout[t][3]
        u = t + 1
        while u < len(layout) and layout[u][3] + layout[u][4] - lo <= round_bytes:
            u += 1
        out.append((lo, layout[u - 1][3] + layout[u - 1][4], t, u))
        t = u
    return out


class _Group:
    """One group load: open, agree, cut the rounds, read and exchange them in a window, yield.

    ``staging`` says where the rounds land: ``"whole"`` one block of the checkpoint's size
    (an owned load's output), ``"fresh"`` a block per round that lives as long as a tensor
    handed out of it (a stream), ``"ring"`` as many reused blocks as rounds in flight (a caller
    that keeps nothing it was handed past the next step: ``load_into``, tensor parallelism)."""

    def __init__(self, source, group, framework, max_header_size, bucket_bytes, chunk_bytes, wanted, remote,
                 staging: str = "fresh", memory_limit: int | None = None) -> None:
        import torch.distributed as dist

        self.wanted = wanted  # load_into's (destinations, strict, targets filled here)
        self.given = group  # the caller's group: its backend may move device tensors (DEVICE_PAYLOADS)
        self.backend = dist.get_backend(group)
        group = _gloo_of(group)
        self.source, self.group, self.framework, self.remote = os.fspath(source), group, framework, remote
        self.max_header_size, self.bucket = max_header_size, max(1, int(bucket_bytes))
        self.step = max(1, chunk_bytes or _CHUNK)
        self.staging, self.limit = staging, memory_limit
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.select, self.quantize = None, None
        self.spec = None  # the quantize spec, checked with the rest before any exchange
        self.verify = True  # whether this load checks checksums (read once, when it starts)
        self.checks_of: list = []  # each file's Checks, or None
        self.meta: dict[str, tuple[str, tuple]] = {}  # name -> (format dtype, shape), file order
        self.deadline: float | None = READ_DEADLINE  # seconds a round's reads may take on this rank
        self.stalled = False  # a read passed the deadline: its thread is left, not joined
        self.interrupted = False  # a Ctrl-C taken while the engine's steps ran, for the next agreement
        self.reads = "node"  # who reads for whom (READS)
        self.readers: list[int] = list(range(self.world))  # the ranks that read the bytes this rank gets
        self.xgroup = group  # the group its rounds' bytes are sent over: the node's or the whole group
        self.device: Any = None  # where the rounds' bytes travel, where not in host memory (load_into's device)
        self.on: Any = None  # the device a caller puts the tensors on (tensor parallelism)
        self.to: Any = None  # the device the tensors handed out are copied to (stream's ``device``)
        self.stats = False
        self._taken: Any = None  # the SIGINT handler that takes it, while installed

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        from engine.format.header import MAX_HEADER_SIZE

        self.verify = verifying()  # read once: every round of every rank checks the same way
        with contextlib.ExitStack() as stack:
            self._defer()
            stack.callback(self._allow)
            parts: list = []
            commit, content = (lambda: None), ""
            failed: BaseException | None = None
            missing: BaseException | None = None  # this rank has no copy of the source
            try:  # what can fail on one rank alone, before the first collective
                if self.reads not in READS:
                    from engine.errors import OptionError

                    raise OptionError(f"reads={self.reads!r}: a group load reads {' or '.join(map(repr, READS))}",
                                      option="reads")
                _check_options(self.source, self.remote)
                self.limit = memory.checked(self.limit)
                try:
                    parts, commit, content = stack.enter_context(
                        _parts(self.source, self.remote, self.max_header_size or MAX_HEADER_SIZE))
                except FileNotFoundError as exc:
                    if is_url(self.source) or os.path.lexists(self.source):
                        raise  # a copy that lacks a shard is a broken copy, not none
                    missing = exc
            except BaseException as exc:
                failed = exc
            hosts, holds = self._meet(failed, missing)
            heads = None
            if not all(holds):  # the ranks without a copy take the headers of the first that has one
                heads, content = self._headers(parts, content, holds)
            self._readers(hosts, holds)
            try:  # everything else that can fail on one rank alone, before the first exchange
                if not holds[self.rank]:
                    parts = self._parsed(heads)
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
                    self.device = _payload_device(self.backend, self.wanted[2].values())
                if self.on is not None and self.backend in DEVICE_PAYLOADS:
                    if self.on.type not in PAYLOAD_DEVICES:
                        from engine.errors import OptionError

                        raise OptionError(f"a {self.backend} group moves {' or '.join(sorted(PAYLOAD_DEVICES))} "
                                          f"tensors, and the tensors go to {str(self.on)!r}", option="device")
                    self.device = self.on
                if self.quantize is not None:
                    from engine.numerics.quantize import Int8

                    self.spec = Int8.of(self.quantize)
                if self.to is not None and (self.framework != "pt" or self.spec is not None or self.stats):
                    from engine.errors import DeviceError

                    raise DeviceError(f"a group load to {str(self.to)!r} hands out torch tensors, without stats or "
                                      "quantize (those run on the CPU)", reason="UnsupportedDevice")
                # each file's checks, looked up once (None: no checksums, or not checking); a header
                # that fails its own checksum, and an empty tensor's wrong one, fail here
                self.checks_of = [Checks.of(p.header, p.path) if self.verify else None for p in parts]
                if self.verify:
                    for i, r, _, _, n in layout:
                        checks = self.checks_of[i]
                        if checks is not None and not n:
                            checks.verify_bytes(r, b"")
                total = layout[-1][3] + -(-layout[-1][4] // _ALIGN) * _ALIGN if layout else 0
                largest = max((n for *_, n in layout), default=0)
                # the round size this rank can hold; the group agrees on the smallest asked
                asked = self.bucket if self.staging == "whole" else \
                    memory.rounds(self.limit, largest, self.bucket, self.source)[0]
                fingerprint = self._fingerprint(parts, layout, total, content)
                from engine.sinks._host import host_block

                block = host_block(total) if self.staging == "whole" else None
            except BaseException as exc:  # every rank hears of it before any exchange
                self._agree(exc)
                raise  # (not reached: _agree raised)
            round_bytes = self._agree(None, fingerprint, asked)
            rounds = self._plan(parts, layout, round_bytes)
            window = len(rounds) if self.staging == "whole" else memory.in_flight(self.limit, round_bytes, largest)
            pool = concurrent.futures.ThreadPoolExecutor(max(1, min(self.remote.get("connections") or 8, 64)),
                                                         thread_name_prefix="engine-group")
            # a failed round stops the reads; a read stuck past the deadline (a hung mount) is left behind
            stack.callback(lambda: pool.shutdown(wait=not self.stalled, cancel_futures=True))
            failed = yield from self._rounds(parts, layout, rounds, block, window, pool)
            try:  # a rank's last step (its cache_dir copy linked into place) fails every rank
                if failed is None:
                    commit()
            except BaseException as exc:
                failed = exc
            self._agree(failed)  # the last agreement: no rank leaves while another may still fail

    def _fingerprint(self, parts, layout, total: int, content: str = "") -> int:
        """63 bits of the layout (names, dtypes, shapes, offsets), of what the rank's copy of the
        bytes is (``content``: two revisions with one header differ there) and of the options
        every rank must share (ranks that check different things would run different
        collectives)."""
        from engine.format.checksums import canonical_digest

        digest = canonical_digest([n for _, _, n, _, _ in layout],
                                  [int(parts[i].header.table.codes[r]) for i, r, _, _, _ in layout],
                                  [parts[i].header.table.shapes[r] for i, r, _, _, _ in layout],
                                  [off for _, _, _, off, _ in layout], [n for *_, n in layout], None)
        from engine.format.checksums import KEY

        # the checksum entries too: ranks that check different things would run different collectives
        entries = hashlib.blake2b("|".join(str((p.header.metadata or {}).get(KEY)) for p in parts).encode()).hexdigest()
        # where the payloads travel too: ranks that send over different groups would wait on each other
        text = f"{digest}:{total}:{self.verify}:{self.wanted is not None}:{entries}:{content}:{self.device is None}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")

    def _agree(self, failed: BaseException | None, fingerprint: int = 0, round_bytes: int = 0) -> int:
        """:func:`agree` on this load's group (a Ctrl-C taken since the last one is this rank's
        failure); returns the smallest ``round_bytes`` any rank gave (each rank's memory limit
        holds it)."""
        if failed is None and self.interrupted:
            failed = KeyboardInterrupt()
        return agree(self.group, self.source, failed, fingerprint, round_bytes)

    def _meet(self, failed: BaseException | None, missing: BaseException | None) -> tuple[list[str], list[bool]]:
        """The first collective: every rank hears whether any failed before it (and then raises
        as :func:`agree` does), which ranks hold a copy of the source, the machine each runs on,
        and whether all asked to read the same way.  Returns ``(hosts, holds)`` by group rank."""
        import socket

        import torch.distributed as dist

        if failed is None and self.interrupted:
            failed = KeyboardInterrupt()
        mine = (None if failed is None else f"{type(failed).__name__}: {failed}", socket.gethostname(),
                missing is None, self.reads, None if missing is None else f"{type(missing).__name__}: {missing}")
        got: list[Any] = [None] * self.world
        with _peers(self.source):
            dist.all_gather_object(got, mine, group=self.group)
        causes = [g[0] for g in got]
        if not any(g[2] for g in got):  # no rank has a copy: each fails as it would alone
            causes = [g[4] for g in got]
            failed = failed or missing
        if any(c is not None for c in causes):
            if isinstance(failed, KeyboardInterrupt):
                raise failed
            who = next(k for k, c in enumerate(causes) if c is not None)
            raise DistributedLoadError(f"rank {who} of the process group failed: {causes[who]}", rank=who,
                                       cause=causes[who], reason="GroupReadFailed", path=self.source) from failed
        if len({g[3] for g in got}) > 1:
            raise DistributedLoadError("the ranks of the process group asked for different reads= "
                                       f"({sorted({g[3] for g in got})}): give every rank the same",
                                       reason="GroupMismatch", path=self.source)
        return [g[1] for g in got], [g[2] for g in got]

    def _headers(self, parts, content: str, holds: list[bool]) -> tuple[list | None, str]:
        """Each file's ``8 + N`` header bytes, from the first rank that holds a copy to every
        rank (``broadcast_object_list``), and its content digest: what a rank without a copy
        parses (:meth:`_parsed`).  A read that fails there fails every rank."""
        import torch.distributed as dist

        from engine.io.reader import pread_into

        sender = holds.index(True)
        box: list[Any] = [None]
        if self.rank == sender:
            try:
                heads = []
                for p in parts:
                    prefix = bytearray(p.header.data_start)
                    pread_into(p.fd, 0, [memoryview(prefix)], path=p.path)
                    heads.append((os.path.basename(p.path), bytes(prefix), int(p.header.file_size)))
                box[0] = (heads, content, None)
            except Exception as exc:
                box[0] = (None, "", f"{type(exc).__name__}: {exc}")
        with _peers(self.source):
            dist.broadcast_object_list(box, src=self._src(sender), group=self.group)
        heads, content, cause = box[0]
        if cause is not None:
            raise DistributedLoadError(f"rank {sender} of the process group failed: {cause}", rank=sender,
                                       cause=cause, reason="GroupReadFailed", path=self.source)
        return heads, content

    def _parsed(self, heads) -> list:
        """The parts of a rank without a copy: each header parsed and checked as a file's, no
        descriptor (it reads nothing: its shares of the rounds are empty)."""
        from engine.format.header import MAX_HEADER_SIZE, parse_prefix
        from engine.loading.loader import Part

        out = []
        for name, prefix, size in heads:
            if self.source.endswith(".json"):  # an index: the shards beside it
                path = os.path.join(os.path.dirname(self.source), name)
            elif os.path.basename(self.source) == name:  # the file itself
                path = self.source
            else:  # a folder
                path = os.path.join(self.source, name)
            header = parse_prefix(prefix, file_size=size, path=path,
                                  max_header_size=self.max_header_size or MAX_HEADER_SIZE)
            out.append(Part(-1, header, header.table.file_order(), path))
        return out

    def _readers(self, hosts: list[str], holds: list[bool]) -> None:
        """Who reads the bytes this rank gets, and over which group they come: with ``reads="node"``
        the ranks of this machine that hold a copy, over a group of the machine's ranks (made
        once, by them alone); with ``"group"``, or where a machine has no copy at all, every rank
        that holds one, over the whole group."""
        everyone = list(range(self.world))
        if self.reads == "node" and len(set(hosts)) > 1 and \
                all(any(holds[k] for k in everyone if hosts[k] == h) for h in set(hosts)):
            node = [k for k in everyone if hosts[k] == hosts[self.rank]]
            self.readers = [k for k in node if holds[k]]
            self.xgroup = _subgroup(self.group, [self._src(k) for k in node])
            return
        self.readers = [k for k in everyone if holds[k]]
        self.xgroup = self.group

    def _defer(self) -> None:
        """While the engine's own steps run on the main thread, a Ctrl-C is taken at the next
        agreement, where every rank hears of it, instead of between two collectives, where the
        others would wait for this rank forever; a second Ctrl-C interrupts at once."""
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return

        def taken(signum, frame) -> None:
            if self.interrupted:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            self.interrupted = True

        self._taken = taken
        signal.signal(signal.SIGINT, taken)

    def _allow(self) -> None:
        """Ctrl-C as Python takes it, while a stream's consumer runs (and once the load ends)."""
        import signal

        if self._taken is not None and signal.getsignal(signal.SIGINT) is self._taken:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self._taken = None

    def _wait(self, f, due: float | None) -> None:
        """``f``'s result, a deferred Ctrl-C or the deadline, whichever comes first."""
        while True:
            try:
                f.result(_POLL if due is None else max(0.0, min(_POLL, due - time.monotonic())))
                return
            except concurrent.futures.TimeoutError:
                if self.interrupted:
                    raise KeyboardInterrupt from None
                if due is not None and time.monotonic() >= due:
                    self.stalled = True
                    raise TimeoutError(f"rank {self.rank}'s reads of a round took more than read_deadline="
                                       f"{self.deadline:g} s (a stalled file system or server)") from None

    def _src(self, k: int) -> int:
        """The global rank of the group's rank ``k`` (what ``broadcast`` takes)."""
        import torch.distributed as dist

        return dist.get_global_rank(self.group, k) if self.group is not None else k

    def _plan(self, parts, layout, round_bytes: int) -> list[_Round]:
        """The rounds, each cut into a share of equal bytes per reader (a tensor may lie in two
        shares), and this rank's reads (pieces of at most ``step`` bytes within one tensor)."""
        keeps = [getattr(p.ranges, "keep", None) for p in parts]  # a URL's cache_dir copy
        out = []
        for lo, hi, first, end in _cut(layout, round_bytes):
            cuts = [(lo + a, lo + b) for a, b in spans(hi - lo, len(self.readers))]
            rd = _Round(lo, hi, first, end, cuts, [], [], [], [])
            for i, r, _, off, n in layout[first:end]:
                owners = [(k, max(a, off), min(b, off + n)) for k, (a, b) in zip(self.readers, cuts, strict=True)
                          if max(a, off) < min(b, off + n)]
                if len(owners) > 1:
                    rd.split.append((i, r, off, n, owners))
                begin = parts[i].header.data_start + int(parts[i].header.table.begins[r])
                for k, a, b in owners:
                    if k != self.rank:
                        if keeps[i]:  # the bytes other ranks read, for this rank's local copy
                            rd.theirs.append((i, begin + (a - off), a, b - a))
                        continue
                    mine = []
                    for c in range(a, b, self.step):
                        mine.append(len(rd.pieces))
                        rd.pieces.append((i, begin + (c - off), c, min(self.step, b - c)))
                    if len(owners) == 1:
                        rd.whole.append((i, r, off, n, mine))
            out.append(rd)
        return out

    def _rounds(self, parts, layout, rounds: list[_Round], block, window: int,
                pool) -> Generator[tuple[str, Any], None, BaseException | None]:
        """Read and exchange ``rounds``, ``window`` of them in flight, and yield each round's
        tensors once its bytes are on every rank; returns a failure of this rank's after the
        last exchange, for the last agreement."""
        import torch
        import torch.distributed as dist

        from engine.format.checksums import verify_received
        from engine.loading import sink_for
        from engine.sinks._host import host_block

        sink = sink_for(self.framework) if self.framework != "raw" else None
        keeps: list[Any] = [getattr(p.ranges, "keep", None) for p in parts]
        cap = max((rd.hi - rd.lo for rd in rounds), default=0)
        ring: list[Any] = []  # "ring": the reused blocks, made as the first rounds need them
        dring: list[Any] = []  # with payloads on a device: a device block per round in flight
        payload = self.xgroup
        if self.device is not None and self.xgroup is not self.group:  # a machine's ranks, in the caller's backend
            payload = _subgroup(self.given, dist.get_process_group_ranks(self.xgroup), self.backend)
        elif self.device is not None:
            payload = self.given
        staged: dict[int, tuple[Any, int, Any, list]] = {}  # round -> (block, its offset, bytes, reads)

        def read(i: int, offset: int, dst, fresh: bool = False) -> None:
            p = parts[i]
            if p.ranges is not None:
                (getattr(p.ranges, "fresh", p.ranges) if fresh else p.ranges)(offset, [dst])
            else:
                from engine.io.reader import pread_into

                pread_into(p.fd, offset, [dst], path=p.path)

        def stage(j: int) -> None:  # a block for round j, and its reads submitted
            rd = rounds[j]
            if self.staging == "whole":
                blk, base = block, 0
            elif self.staging == "ring":
                if len(ring) < window:
                    ring.append(host_block(cap))
                blk, base = ring[j % window], rd.lo
            else:
                blk, base = host_block(rd.hi - rd.lo), rd.lo
            flat = np.frombuffer(blk, np.uint8)
            view = memoryview(flat)
            staged[j] = (blk, base, flat, [pool.submit(read, i, offset, view[a - base : a - base + n])
                                           for i, offset, a, n in rd.pieces])

        # a stream hands its tensors to the caller's code; the other loads to the engine's own (a dict,
        # the copies of load_into, tensor parallelism's cuts), where a Ctrl-C waits for the next agreement
        yours = self.staging == "fresh"
        ahead = 0
        pending: BaseException | None = None  # a failure after a round's exchange, agreed at the next
        for j, rd in enumerate(rounds):
            while ahead < min(len(rounds), j + window):  # the window: rounds j .. j + window - 1
                stage(ahead)
                ahead += 1
            blk, base, flat, reads = staged.pop(j)
            view = memoryview(flat)
            failed, pending = pending, None
            try:
                due = None if self.deadline is None else time.monotonic() + self.deadline
                for f in reads:
                    self._wait(f, due)
                if self.verify and failed is None:  # read again from a server on a mismatch, before it is sent
                    for i, r, off, n, mine in rd.whole:
                        checks = self.checks_of[i]
                        got = view[off - base : off - base + n]
                        if parts[i].ranges is None:  # a local file: its bytes are what they are
                            if checks is not None:
                                checks.verify_bytes(r, got)
                            continue

                        def again(mine: list[int] = mine, rd: _Round = rd, view=view, base: int = base) -> None:
                            for x in mine:  # from the server, not a kept stream
                                i, offset, a, n = rd.pieces[x]
                                read(i, offset, view[a - base : a - base + n], fresh=True)

                        verify_received(checks, r, got, again)
            except BaseException as exc:  # every rank hears of it before the round's collectives
                failed = failed or exc
            self._agree(failed)
            dev = None
            if self.device is not None:  # this rank's share up to the device; the others' come there
                if len(dring) < window:
                    dring.append(_device_block(cap, self.device))
                dev = dring[j % window]
                for k, (a, b) in zip(self.readers, rd.cuts, strict=True):
                    if k == self.rank and a < b:
                        dev[a - rd.lo : b - rd.lo].copy_(torch.from_numpy(flat[a - base : b - base]))
            with _peers(self.source):  # every share's broadcast in flight at once: the links work together
                works = [dist.broadcast(torch.from_numpy(flat[a - base : b - base]) if dev is None else
                                        dev[a - rd.lo : b - rd.lo], src=self._src(k),
                                        group=self.xgroup if dev is None else payload, async_op=True)
                         for k, (a, b) in zip(self.readers, rd.cuts, strict=True) if a < b]
                for work in works:
                    work.wait()
            if dev is not None:  # what is checked or kept on the host comes back from the device
                back = [(a, n) for _, _, a, n in rd.theirs]
                if self.verify:
                    back += [(off, n) for i, _, off, n, _ in rd.split if self.checks_of[i] is not None]
                for a, n in back:
                    torch.from_numpy(flat[a - base : a - base + n]).copy_(dev[a - rd.lo : a - rd.lo + n])
            try:
                for i, offset, a, n in rd.theirs:
                    keeps[i](offset, [view[a - base : a - base + n]])
            except BaseException as exc:  # this rank's cache_dir copy: the others hear of it at the next agreement
                pending = exc
            if self.verify:
                for item in rd.split:
                    try:
                        self._verify_split(item, parts, flat, base, read, keeps)
                    except BaseException as exc:
                        if self.xgroup is self.group:
                            raise  # every rank of the group checked the same bytes: the same verdict
                        self._agree(exc)  # the other nodes hear of it at their next agreement
                        raise
                    if dev is not None and self.checks_of[item[0]] is not None:  # bytes read again reach the device
                        _, _, off, n, _ = item
                        dev[off - rd.lo : off - rd.lo + n].copy_(torch.from_numpy(flat[off - base : off - base + n]))
            for t in range(rd.first, rd.end):
                i, r, name, off, n = layout[t]
                if dev is not None:
                    out = dev[off - rd.lo : off - rd.lo + n]
                    if sink is not None:  # the tensor's dtype and shape over its device bytes
                        table = parts[i].header.table
                        out = _device_view(out, int(table.codes[r]), tuple(table.shapes[r]))
                elif sink is None:
                    out = flat[off - base : off - base + n]
                else:
                    table = parts[i].header.table
                    out = sink.view(blk, int(table.codes[r]), table.shapes[r], off - base, n)
                if yours:  # the caller's code runs until the next step: Ctrl-C as Python takes it there
                    self._allow()
                try:
                    yield name, out
                except GeneratorExit:  # the consumer raised or left the loop: the others must not wait for it
                    self._leave()
                    raise
                if yours:
                    self._defer()
                del out
            del blk, flat, view  # a fresh block lives on only in the tensors handed out of it
        return pending

    def _leave(self) -> None:
        """This rank stops before the load ended (its consumer raised, broke out of the loop or
        closed the stream): the others hear of it at their next agreement, which is this one's
        last collective, and raise; this rank only closes."""
        try:
            self._agree(_Stopped(f"rank {self.rank}'s consumer stopped the load (it raised, or left the loop) "
                                 "before its end"))
        except DistributedLoadError:
            pass

    def _verify_split(self, item, parts, flat, base: int, read, keeps) -> None:
        """Check a tensor that several ranks read, on every rank (the same bytes everywhere,
        so the same verdict).  A mismatch of bytes from a server: each owner reads its part
        again and sends it again, until the checksum passes or two reads agree; then every
        rank raises."""
        import torch
        import torch.distributed as dist

        from engine.errors import ChecksumError
        from engine.format.checksums import crc32c, read_again, read_until_agreed

        i, r, off, n, owners = item
        checks = self.checks_of[i]
        if checks is None:
            return
        first = crc32c(flat[off - base : off - base + n])
        try:
            checks.verify(r, first)
            return
        except ChecksumError as exc:
            err = exc
        begin = parts[i].header.data_start + int(parts[i].header.table.begins[r])
        view = memoryview(flat)

        def again() -> int:
            failed: BaseException | None = None
            try:
                for k, a, b in owners:
                    for c in range(a, b, self.step) if k == self.rank else ():
                        m = min(self.step, b - c)
                        read(i, begin + (c - off), view[c - base : c - base + m], fresh=True)
            except Exception as exc:
                failed = exc
            if failed is None and self.interrupted:
                failed = KeyboardInterrupt()
            agree(self.xgroup, self.source, failed)  # the readers of this node (or of the group)
            with _peers(self.source):
                for k, a, b in owners:
                    dist.broadcast(torch.from_numpy(flat[a - base : b - base]), src=self._src(k), group=self.xgroup)
                    if k != self.rank and keeps[i]:
                        keeps[i](begin + (a - off), [view[a - base : b - base]], again=True)
            return crc32c(flat[off - base : off - base + n])

        if parts[i].ranges is not None:
            crc, agreed = read_until_agreed(first, int(checks.expected[r]), again)
            if crc == int(checks.expected[r]):
                return
            err = read_again(err, crc, agreed)
        who = ", ".join(str(k) for k, _, _ in owners)
        raise DistributedLoadError(f"a tensor read by rank(s) {who} failed its checksum on every rank: {err}",
                                   rank=owners[0][0] if len(owners) == 1 else None, cause=f"ChecksumError: {err}",
                                   reason="GroupReadFailed", path=self.source, tensors=err.tensors) from err


def agree(group, source, failed: BaseException | None, fingerprint: int = 0, least: int = 0) -> int:
    """Every rank of ``group`` (gloo's) learns whether any failed (and then which, and why), and
    whether all saw the same checkpoint (``fingerprint``): no rank goes on to a collective that
    another will never reach.  Returns the smallest ``least`` any rank gave.

    Raises
    ------
    DistributedLoadError
        On every rank: ``"GroupReadFailed"`` naming the first rank that failed and its cause,
        ``"GroupMismatch"`` where the fingerprints differ, ``"GroupFailed"`` where a rank left.
    """
    import torch
    import torch.distributed as dist

    status = torch.tensor([int(failed is not None), fingerprint, -fingerprint, -least], dtype=torch.int64)
    with _peers(source):
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=group)
    if int(status[0]):
        causes: list[str | None] = [None] * dist.get_world_size(group)
        mine = None if failed is None else f"{type(failed).__name__}: {failed}"
        with _peers(source):
            dist.all_gather_object(causes, mine, group=group)
        who = next(k for k, c in enumerate(causes) if c is not None)
        if isinstance(failed, KeyboardInterrupt):  # every other rank hears of it; this one is interrupted
            raise failed
        raise DistributedLoadError(f"rank {who} of the process group failed: {causes[who]}", rank=who,
                                   cause=causes[who], reason="GroupReadFailed", path=os.fspath(source)) from failed
    if int(status[1]) != -int(status[2]):
        raise DistributedLoadError("the ranks of the process group were given different checkpoints or options "
                                   "(names, dtypes, shapes, offsets, the bytes sampled from each file or its ETag, "
                                   "verify_checksums or load_into differ): give every rank the same",
                                   reason="GroupMismatch", path=os.fspath(source))
    return -int(status[3])


#: the gloo group of each non-gloo group's ranks (by the group's name), made once
_GLOO: dict[str, Any] = {}


def _gloo_of(group):
    """``group`` where it is gloo's (or the default group is and ``group`` is None), else a
    gloo group of the same ranks, made once per group by its members alone
    (``use_local_synchronization``): the agreements and the host bytes of a group load go over
    it, since an NCCL group's collectives take CUDA tensors only."""
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":
        return group
    name = dist._get_process_group_name(group) if group is not None else "default"
    if name not in _GLOO or not _alive(_GLOO[name]):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        _GLOO[name] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _GLOO[name]


def _alive(group) -> bool:
    """Whether a group made here is still registered: ``destroy_process_group`` drops every
    group, and a group made after a new ``init_process_group`` may take a dropped one's name."""
    from torch.distributed import distributed_c10d

    return group in distributed_c10d._world.pg_map


#: the gloo groups of a machine's ranks within a group (by the group's name and their global ranks)
_SUBGROUPS: dict[tuple[str, tuple[int, ...], str], Any] = {}


def _subgroup(group, ranks: list[int], backend: str = "gloo"):
    """A group of ``ranks`` (global ranks, all within ``group``) on ``backend``, made once, by
    its members alone (``use_local_synchronization``): other machines' ranks make theirs meanwhile."""
    import torch.distributed as dist

    name = dist._get_process_group_name(group) if group is not None else "default"
    if len(ranks) == (dist.get_world_size(group)):
        return group
    key = (name, tuple(ranks), backend)
    if key not in _SUBGROUPS or not _alive(_SUBGROUPS[key]):
        _SUBGROUPS[key] = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True)
    return _SUBGROUPS[key]


#: backends whose collectives move device memory: a group load into that device's tensors sends its
#: rounds there (NVLink between a machine's GPUs) instead of through host memory and gloo
DEVICE_PAYLOADS = frozenset({"nccl"})
#: the device types whose tensors those payloads fill
PAYLOAD_DEVICES = frozenset({"cuda"})


def _payload_device(backend: str, targets) -> Any:
    """The device of ``load_into``'s destinations where the group's backend moves its memory
    and every destination is a torch tensor on that one device; else None (host payloads)."""
    if backend not in DEVICE_PAYLOADS:
        return None
    devices = {getattr(getattr(t, "tensor", None), "device", None) for t in targets}
    if len(devices) != 1:
        return None
    (device,) = devices
    if getattr(device, "type", None) not in PAYLOAD_DEVICES or not all(
            hasattr(t.tensor, "untyped_storage") for t in targets):
        return None
    return device


#: devices whose tensors a group stream hands out as views of its rounds' host blocks
HOST_DEVICES = frozenset({"cpu"})


def _device_of(device) -> Any:
    """``device`` as a ``torch.device`` where a group load copies its tensors there; None for
    the host (the rounds' own views)."""
    if device is None or (isinstance(device, str) and device.partition(":")[0] in HOST_DEVICES):
        return None
    import torch

    out = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return None if out.type in HOST_DEVICES else out


def _device_view(raw, code: int, shape: tuple):
    """A torch tensor of dtype ``code`` and ``shape`` over ``raw``, a uint8 device tensor at a
    64-byte offset of its block (a packed sub-byte dtype's shape is its bytes')."""
    from engine.base import dtypes

    if code in dtypes.SUB_BYTE_CODES:
        shape = dtypes.packed_shape(code, shape, raw.numel())
    return raw.view(dtypes.torch_dtype(code)).view(shape)


def _device_block(nbytes: int, device):
    """A round's block on ``device`` (torch's allocator: stream-ordered reuse)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class _Stopped(Exception):
    """Why a rank left a group load before its end (what the other ranks are told)."""


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


#: spans of each local file's data region that every rank hashes before a group load: copies of
#: two revisions of a checkpoint with one header (most record no checksums) differ there
SAMPLES, SAMPLE_BYTES = 16, 4096


def _sampled(parts) -> str:
    """A digest of :data:`SAMPLES` spans of :data:`SAMPLE_BYTES` spread over each file's data
    region, and of its size (64 KiB read per file, whatever its size)."""
    from engine.io.reader import pread_into

    h = hashlib.blake2b(digest_size=16)
    buf = memoryview(bytearray(SAMPLE_BYTES))
    for p in parts:
        size = int(p.header.data_size)
        h.update(size.to_bytes(8, "little"))
        for k in range(SAMPLES):
            at = size * k // SAMPLES
            n = min(SAMPLE_BYTES, size - at)
            if n > 0:
                pread_into(p.fd, p.header.data_start + at, [buf[:n]], path=p.path)
                h.update(buf[:n])
    return h.hexdigest()


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

