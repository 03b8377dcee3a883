"""``engine.safe_open(url)``: the reference's handle over a remote file or checkpoint.

A :class:`RemoteHandle` reads the headers once (two ranged GETs per file, see
:mod:`engine.urls._remote_files`) and then reads tensor bytes only when asked: ``get_tensor``
one range (split over the load's connections when it is large), ``get_slice(...)[...]``
only the rows the index selects (neighbouring runs share a request, see
:func:`engine.net.views.read_runs`), ``get_tensors`` every selected tensor in parallel
through the same pipeline as :func:`engine.urls.remote_load.stream`.  Every request has the
deadlines, retries and ETag pinning of :mod:`engine.net.remote_reads`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.base import dtypes
from engine.errors import InvalidSliceError, SafetensorError, TensorNotFoundError
from engine.format.checksums import Checks, verify_received, verifying
from engine.io.reader import map_threads
from engine.loading.loader import sink_for, stream_parts
from engine.net.views import read_runs
from engine.urls.remote_load import RemoteParts, open_parts, remote_options

__all__ = ["RemoteHandle", "RemoteSlice"]

#: a tensor larger than this is read by several connections at once
_SPLIT_BYTES = 32 << 20


class RemoteHandle:
    """:class:`engine.safe_open` for an ``http(s)://``, ``s3://`` or fsspec URL of a file,
    an index or a prefix (parameters as :func:`engine.urls.remote_load.stream` takes them:
    ``headers``, ``timeout``, ``connections``, ``retry``, ``s3``, ``storage_options``,
    ``cache_dir``).

    With ``cache_dir`` (:mod:`engine.urls.remote_cache`), opening downloads every file that has no
    copy there of the version the server has (``connections`` ranged GETs at a time, each
    body received into the new file), and the handle then reads the local copies; a file
    that cannot be copied (no ETag or ``Last-Modified``, a full disk) is read from the
    server as without ``cache_dir``.

    Copies of tensor bytes: 1 on the CPU (socket to the tensor, or the local copy to the
    tensor), plus the host-to-device copy for a device; the download with ``cache_dir`` 1
    (socket to the file's pages).
    """

    def __init__(self, filename: str, framework: str = "np", device: Any = "cpu", *,
                 backend: str | None = None,  # safe_open's; a remote file has no mapping to choose
                 verify_checksums: bool | None = None, **options) -> None:
        remote = remote_options(options)
        if options:  # before any request: with cache_dir, opening downloads the files
            raise TypeError(f"unexpected options for a remote safe_open: {sorted(options)}")
        # with cache_dir: every file is first downloaded into the cache, then read from there
        opened = open_parts(filename, download=True, **remote)
        self._setup(opened, filename, framework, device, verify_checksums)

    @classmethod
    def of_parts(cls, opened: RemoteParts, url: str, framework: str = "np", device: Any = "cpu") -> RemoteHandle:
        """A handle over files already opened by :func:`engine.urls.remote_load.open_parts`
        (it closes them when it is closed)."""
        self = cls.__new__(cls)
        self._setup(opened, url, framework, device)
        return self

    def _setup(self, opened: RemoteParts, url: str, framework: str, device: Any,
               verify_checksums: bool | None = None) -> None:
        # whole tensors are checked against their file's checksums, where it records them
        self._verify = verifying() if verify_checksums is None else bool(verify_checksums)
        self._framework = framework
        self._device = device
        self._sink = sink_for(framework, device)
        self._torch = framework in ("pt", "torch")
        opened.ranged()  # a file's local copy (cache_dir) is read by positional reads
        # a handle may read a tensor twice: a server that ignores Range streams each file
        # once, and what the stream passes is kept
        opened.reads.keep = True
        self._opened: RemoteParts | None = opened
        self._url = url
        self._where: dict[str, tuple[int, int]] = {}
        for i, p in enumerate(self._opened.parts):
            for row, name in enumerate(p.header.table.names):
                self._where.setdefault(name, (i, row))

    # -- the reference's surface ---------------------------------------------------------

    def __enter__(self) -> RemoteHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None

    @property
    def _parts(self):
        if self._opened is None:
            raise SafetensorError("the handle is closed", reason="Closed", path=self._url)
        return self._opened.parts

    @property
    def info(self):
        """The headers as a :class:`~engine.checkpoints.checkpoint.CheckpointInfo`, as
        :attr:`engine.Checkpoint.info` of a local checkpoint (the index's metadata and weight
        map included); shard names are the files' base names."""
        if self._opened is None:
            raise SafetensorError("the handle is closed", reason="Closed", path=self._url)
        return self._opened.info

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._where)

    def offset_keys(self) -> list[str]:
        """Tensor names in file order (shard by shard)."""
        return [p.header.table.names[r] for p in self._parts for r in p.header.table.file_order()]

    def metadata(self) -> dict[str, str] | None:
        """``__metadata__`` of the file; of a checkpoint, the entries every shard shares."""
        metas = [p.header.metadata for p in self._parts]
        if len(metas) == 1 or not metas:
            return metas[0] if metas else None
        common = {k: v for k, v in (metas[0] or {}).items() if all((m or {}).get(k) == v for m in metas[1:])}
        return common or None

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def _locate(self, name: str) -> tuple[Any, int]:
        try:
            i, row = self._where[name]
        except KeyError:
            raise TensorNotFoundError.for_name(name, list(self._where), where="file", path=self._url) from None
        return self._parts[i], row

    def get_tensor(self, name: str):
        """One tensor, read with ranged GETs of just its bytes."""
        part, row = self._locate(name)
        t = part.header.table
        code, begin, end = int(t.codes[row]), int(t.begins[row]), int(t.ends[row])
        arr = self._sink.empty(code, t.shapes[row], end - begin)
        raw = self._sink.raw(arr) if end > begin else memoryview(b"")

        def fetch(fresh: bool = False) -> None:  # fresh: from the server, not what a stream kept
            offset = part.header.data_start + begin
            n = end - begin
            assert self._opened is not None
            pieces = max(1, min(self._opened.reads.connections, n // _SPLIT_BYTES))
            cuts = [n * k // pieces for k in range(pieces + 1)]
            read = getattr(part.ranges, "fresh", part.ranges) if fresh else part.ranges
            map_threads(lambda k: read(offset + cuts[k], [raw[cuts[k] : cuts[k + 1]]]), range(pieces),
                        pieces, name="engine-remote")

        if end > begin:
            fetch()
        # one read of the bytes just received, before the tensor is handed out; a mismatch
        # is read again from the server before the file is blamed
        verify_received(Checks.of(part.header, part.path) if self._verify else None, row, raw, lambda: fetch(True))
        return self._sink.to_device(arr)

    def get_slice(self, name: str) -> RemoteSlice:
        """A lazy slice: ``f.get_slice(name)[0:8]`` requests only the bytes those rows hold."""
        part, row = self._locate(name)
        return RemoteSlice(self, part, row)

    def get_tensors(self, names: Iterable[str] | None = None) -> dict:
        """Every tensor (or those named), read in parallel, in file order."""
        parts = self._parts
        wanted = None if names is None else list(names)
        for n in wanted or ():
            self._locate(n)
        opened = self._opened
        assert opened is not None  # self._parts has said so
        got = dict(stream_parts(parts, many=opened.many, framework=self._framework, device=self._device,
                                names=wanted, threads=opened.reads.connections, verify_checksums=self._verify))
        return {n: got[n] for n in self.offset_keys() if n in got}

    def __repr__(self) -> str:
        return f"RemoteHandle({self._url!r}, {len(self._where)} tensors)"


class RemoteSlice:
    """``get_slice`` of a remote tensor: shape and dtype from the header, bytes on indexing."""

    def __init__(self, handle: RemoteHandle, part, row: int) -> None:
        self._handle = handle
        self._part = part
        self._row = row
        t = part.header.table
        self._name = t.names[row]
        self._code = int(t.codes[row])
        self._shape = tuple(t.shapes[row])

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return dtypes.NAMES[self._code]

    def __getitem__(self, index):
        from engine.planning.plan import plan_slice

        d = dtypes.DTYPES[self._code]
        url = self._part.path
        if d.sub_byte:
            raise SafetensorError(f"tensor {self._name!r} has the packed sub-byte dtype {d.name}; slice it after "
                                  "get_tensor()", reason="InvalidSlice", path=url, tensors=(self._name,))
        try:
            plan = plan_slice(self._shape, d.itemsize, index, strict_bounds=not self._handle._torch)
        except InvalidSliceError as err:
            raise InvalidSliceError(f"tensor {self._name!r} {list(self._shape)}: {err.message}",
                                    reason="InvalidSlice", path=url, tensors=(self._name,)) from None
        sink = self._handle._sink
        block = sink.empty(self._code, plan.out_shape, plan.nbytes)
        if plan.nbytes:
            t = self._part.header.table
            base = self._part.header.data_start + int(t.begins[self._row])
            read_runs(self._part.ranges, sink.raw(block), plan.src, plan.run_bytes, base)
        return sink.to_device(sink.finish(block, plan.flip, plan.result_shape))
