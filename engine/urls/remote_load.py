"""Whole loads from HTTP(S), S3, GCS, Azure, Hugging Face Hub and fsspec URLs: parallel ranged reads into the destination.

``engine.stream(url)``, ``engine.torch.load_file(url)``, ``engine.load_into(url, tensors)``
and ``engine.load_tensor_parallel(url, ...)`` come here.  A URL names one
``.safetensors`` file, a ``*.safetensors.index.json``, or a prefix ending in ``/`` (which
holds ``model.safetensors.index.json`` or ``model.safetensors``; an object store's prefix
may also hold several ``.safetensors`` files and no index), or a Hub repo (``hf://org/name``:
its index, or every ``.safetensors`` file at its top).

How the bytes move: the headers come from two ranged GETs per file
(:mod:`engine.urls._remote_files`); the selected tensors are planned as for local files
(:func:`engine.planning.plan.plan_reads`, requests of ``chunk_bytes``), and the pipeline's worker
threads, ``connections`` of them, each take the next request of any shard and receive its
body on a keep-alive connection straight into the destination tensor's memory (CPU), or
take the next chunks of the device's copy ring (:mod:`engine.gpu.device_ring`: one ranged GET
of ``chunk_bytes`` for as many of the ring's chunks, each a block of the file) and receive
it straight into the ring's page-locked chunks, which the ring then copies to the device
(CUDA), through
:mod:`engine.net.remote_reads` (deadlines, retries, ``If-Match``).  Tensors are handed out as
their last byte lands.

Host memory: CPU destinations need none beyond the tensors themselves (each body is
received into them; the kernel's socket buffers and one 4 MiB receive per connection at a
time); CUDA destinations hold the ring's page-locked chunks (128 MiB by default, the ring
local loads use; set up while the headers are fetched), whatever the model's size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from engine.checkpoints.checkpoint import CheckpointInfo
from engine.format.header import MAX_HEADER_SIZE
from engine.format.verification import verification
from engine.io.reader import pread_into
from engine.loading.fill import fill_parts
from engine.loading.loader import Part, prepare_ring, sink_for, stream_parts
from engine.net.remote_file import public_url
from engine.net.remote_reads import DEFAULT_CONNECTIONS, RangeReads
from engine.net.retry import Retry
from engine.urls._remote_files import RemoteSource, checkpoint_info, is_url
from engine.urls.remote import DEFAULT_MAX_REDIRECTS, DEFAULT_MAX_SHARDS, DEFAULT_TIMEOUT
from engine.urls.remote_cache import Copies

__all__ = ["stream", "load", "load_into", "open_parts", "remote_options", "RemoteParts", "is_url",
           "DEFAULT_CHUNK_BYTES", "Retry"]

#: Bytes per ranged GET: measured best on loopback by ``scripts/bench_remote.py --sweep``.
DEFAULT_CHUNK_BYTES = 16 << 20
#: Per ranged GET for CUDA destinations: each fills two of the device ring's 4 MiB
#: page-locked chunks (consecutive slots, adjacent in memory), so that a connection's
#: chunks can be copied while the other connections' requests are still arriving.
DEVICE_CHUNK_BYTES = 8 << 20


class RemoteParts:
    """The open files of one remote load: parts for :mod:`engine.loading.loader` and the shared
    :class:`~engine.net.remote_reads.RangeReads` (close it after the load)."""

    def __init__(self, parts: list[Part], reads: RangeReads, source: str, many: bool,
                 info: CheckpointInfo | None = None, copies: Copies | None = None,
                 src: RemoteSource | None = None) -> None:
        self.parts = parts
        self.reads = reads
        self.source = source
        self.many = many
        #: the headers as a :class:`~engine.checkpoints.checkpoint.CheckpointInfo` (index, weight map)
        self.info = info
        #: the local copies of a load with ``cache_dir`` (:mod:`engine.urls.remote_cache`)
        self.copies = copies
        #: the source the headers were read through (it holds the local Hub cache's files)
        self.src = src

    def local(self) -> bool:
        """Whether every file is read from its local copy (``cache_dir``)."""
        return all(p.ranges is None for p in self.parts)

    def ranged(self) -> RemoteParts:
        """Give every part read from a local copy a ``ranges`` of positional reads, for
        callers that read by ranges (``safe_open``); returns self."""
        self.parts = [p if p.ranges is not None else p._replace(ranges=_local_ranges(p.fd, p.path))
                      for p in self.parts]
        return self

    def commit(self) -> None:
        """The load succeeded: name the complete local copies (with ``cache_dir``)."""
        if self.copies is not None:
            self.copies.commit()

    def close(self) -> None:
        self.reads.close()
        if self.src is not None:
            self.src.close()
        if self.copies is not None:
            self.copies.close()

    def __enter__(self) -> RemoteParts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _local_ranges(fd: int, path: str | None):
    def read(offset: int, views) -> None:
        pread_into(fd, offset, views, path=path)

    return read


def open_parts(
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    max_redirects: int = DEFAULT_MAX_REDIRECTS,
    storage_options: Mapping[str, Any] | None = None,
    s3: Mapping[str, Any] | None = None,
    connections: int | None = None,
    retry: Retry | None = None,
    max_header_size: int = MAX_HEADER_SIZE,
    max_shards: int = DEFAULT_MAX_SHARDS,
    cache_dir: str | os.PathLike | None = None,
    download: bool = False,
) -> RemoteParts:
    """Read the headers of every file a URL names, ready to load (see the module doc).

    Requests: 2 per file (length, header), plus 1 for an index and 1 per 1000 keys of an
    S3 prefix; shards' headers are fetched concurrently.  Their transient failures are
    retried as ``retry`` says, as the bulk reads' are.  With ``cache_dir``
    (:mod:`engine.urls.remote_cache`), a file whose version there is complete becomes a local
    part (read from its copy), and the others' reads also write their copies (call
    :meth:`RemoteParts.commit` once the load succeeded); with ``download`` as well, those
    files are first downloaded whole into the cache and become local parts too (``safe_open``).
    """
    spath = os.fspath(url)
    shown = public_url(spath)  # what errors name: without a user:password part
    retry = retry or Retry()
    workers = connections or DEFAULT_CONNECTIONS
    src = RemoteSource(spath, headers=headers, timeout=timeout, max_redirects=max_redirects,
                       storage_options=storage_options, s3=s3, retry=retry, connections=workers)
    try:
        info, wheres = checkpoint_info(src, max_header_size, max_shards, workers)
    except BaseException:
        src.close()
        raise
    found = list(info.headers.values())
    # the source's client reads on (HTTP, S3: one client for every request of the call); an
    # fsspec source's reads are fsspec's, this one only carries the workers and the cancel
    reads = src.reads or RangeReads(connections=workers, timeout=timeout, retry=retry, headers=headers,
                                    max_redirects=max_redirects)
    copies: Copies | None = None
    parts: list[Part] = []
    try:
        if cache_dir is not None and src.hub is not None and os.fspath(cache_dir) == "hf":
            from engine.urls.hub_cache import HubCopies  # the local Hub cache's own layout

            copies = HubCopies(src.hub)
            for where, data in src.documents.items():  # the index, which transformers looks for too
                copies.keep_document(src.hub.file_of(where), data)
        elif cache_dir is not None:
            copies = Copies(cache_dir)
        wanted = []  # files to download: (their part's index, what Copies.fetch takes)
        dates: dict[str, str | None] = {}  # when the server answered each file's header
        for w, h in zip(wheres, found, strict=True):
            shown_w = src.display(w)
            hub_copy = src.local_path(w)
            if hub_copy is not None:  # already in the local Hub cache at the commit read: from there
                parts.append(Part(src.local_fd(hub_copy), h, [], hub_copy))
                continue
            if copies is None:
                parts.append(Part(-1, h, [], shown_w, src.ranges(w)))
                continue
            version = (src.etags.get(w), src.last_modified.get(w), h, src.raw_headers.get(w))
            date = dates[shown_w] = src.dates.get(w)
            local = copies.open(shown_w, *version, date=date)
            if local is not None:  # read from its copy: no ranges, and no whole-file answer kept for it
                src.forget(w)
                parts.append(Part(local[0], h, [], local[1]))
                continue
            # taken only for a file read from the server: a server that ignores Range hands
            # the header's whole-file answer on to these reads
            ranges = src.ranges(w)
            if download:
                wanted.append((len(parts), (shown_w, *version, ranges)))
                parts.append(Part(-1, h, [], shown_w, ranges))
            else:
                parts.append(Part(-1, h, [], shown_w, copies.wrap(shown_w, *version, ranges, date=date)))
        if wanted:
            assert copies is not None
            got = copies.fetch([f for _, f in wanted], threads=workers, chunk_bytes=DEFAULT_CHUNK_BYTES,
                               cancel=reads.cancel, dates=dates)
            for (i, _), local in zip(wanted, got, strict=True):
                if local is not None:
                    parts[i] = Part(local[0], parts[i].header, [], local[1])
    except BaseException:
        reads.close()
        src.close()
        if copies is not None:
            copies.close()
        raise
    return RemoteParts(parts, reads, shown, many=len(parts) > 1 or info.is_sharded, info=info, copies=copies,
                       src=src)


def remote_options(kw: dict) -> dict:
    """Take the options of :func:`open_parts` out of ``kw``."""
    keys = ("headers", "timeout", "max_redirects", "storage_options", "s3", "connections", "retry",
            "max_header_size", "max_shards", "cache_dir")
    return {k: kw.pop(k) for k in keys if k in kw}


def stream(url: str, *, framework: str = "pt", device: Any = "cpu", chunk_bytes: int | None = None,
           connections: int | None = None, **options) -> Iterator[tuple]:
    """:func:`engine.stream` of a URL: ``(name, tensor)`` as each tensor's last byte lands.

    Parameters
    ----------
    url : str
        ``http(s)://``, ``s3://`` or another fsspec URL of a file, an index or a prefix.
    framework, device, names, patterns, predicate, layers, per_tensor, quantize, gpu_path, slot_bytes
        As :func:`engine.stream` takes them (``stats=True`` needs a local file).
    chunk_bytes : int, optional
        Bytes per ranged GET (default 16 MiB; 8 MiB for CUDA destinations, rounded down to
        whole chunks of the device's ring).
    connections : int, optional
        Parallel requests, each on its own keep-alive connection (default: two per core,
        between 4 and 16).
    headers : mapping, optional
        Sent with every request (``Authorization`` for a gated HTTP file).
    timeout : float, optional
        Seconds for each request (the headers' requests: for all of them together).
    retry : Retry, optional
        Tries per range and the backoff of transient failures.
    s3 : mapping, optional
        ``endpoint_url``, ``region``, ``profile``, ``anonymous``; by default from the
        environment, as boto does.
    storage_options : mapping, optional
        For fsspec protocols (and for ``s3://`` through s3fs instead of natively).
    cache_dir : str or path, optional
        Keep a local copy there of every file whose every data byte this load receives,
        written in the same pass, and read the copies of a later load while the server has
        the same versions (ETag, or ``Last-Modified``, and size); a selection that skips
        any tensor of a file writes no copy of it (:mod:`engine.urls.remote_cache`).  For an
        ``hf://`` URL, ``"hf"`` is the local Hub cache, in its own layout, where
        transformers and vLLM find the files too (:mod:`engine.urls.hub_cache`).

    Raises
    ------
    WriteError
        ``cache_dir`` cannot be created, or is not writable while a file has to be copied
        (before any tensor byte is requested).  A copy that fails while it is written (a
        full disk) is a :class:`~engine.errors.CacheWriteWarning` and the load goes on.

    Notes
    -----
    Copies of tensor bytes: CPU 1 (socket to tensor); CUDA 2 (socket to a page-locked chunk
    of the ring, DMA; with ``quantize`` too: the kernels read the bytes where they landed);
    fsspec protocols one more (fsspec returns ``bytes``); with ``cache_dir`` one more, the
    write of the copy from where the bytes landed (a file read from its copy: those of a
    local owned load, the file to the tensor).
    """
    remote = remote_options(options)
    threads = options.pop("threads", None)
    on_device = str(device) not in ("cpu",) and framework not in ("np", "numpy")
    if on_device and not options.get("stats") and options.get("quantize") is None:
        # the device's ring is set up (page-locked) while the headers are fetched
        prepare_ring(sink_for(framework, device), options.get("slot_bytes"), remote=True)
    with open_parts(url, connections=connections or threads, **remote) as opened:
        workers: int | None = opened.reads.connections
        if opened.local():  # every file from its copy (cache_dir): a local load's threads and reads
            workers = threads
        elif chunk_bytes is None:
            chunk_bytes = DEVICE_CHUNK_BYTES if on_device else DEFAULT_CHUNK_BYTES
        try:
            yield from stream_parts(
                opened.parts, many=opened.many, framework=framework, device=device,
                threads=workers, chunk_bytes=chunk_bytes, cancel=opened.reads.cancel, **options,
            )
            opened.commit()  # every tensor landed: the complete copies get their names
        finally:
            opened.reads.cancel.set()  # a consumer that stopped early ends the waits between tries


def load(url: str, framework: str = "pt", device: Any = "cpu", **options) -> dict[str, Any]:
    """Every selected tensor of a URL, by name in sorted order (as ``safe_open.keys()``);
    the options are those of :func:`stream`."""
    out = dict(stream(url, framework=framework, device=device, **options))
    return {k: out[k] for k in sorted(out)}


def load_into(url: str, tensors: Mapping[str, Any], *, strict: bool = False, chunk_bytes: int | None = None,
              connections: int | None = None, gpu_path: str = "auto", **options) -> list[str]:
    """:func:`engine.load_into` from a URL: fill existing tensors in place.

    Every destination is checked against the headers before a byte of tensor data is
    requested.  When the load fails part way, the error's ``.filled`` lists the names
    whose bytes all landed; the others hold partly written bytes.  ``cache_dir`` as
    :func:`stream` takes it.  Copies of tensor bytes: CPU 1 (socket to the tensor), CUDA 2;
    ``cache_dir`` as :func:`stream`.
    """
    remote = remote_options(options)
    verify = options.pop("verify_checksums", None)
    if options:
        raise TypeError(f"unexpected options: {sorted(options)}")
    with open_parts(url, connections=connections, **remote) as opened, verification(verify):
        on_device = any(getattr(t, "is_cuda", False) or type(t).__module__.startswith("cupy") for t in tensors.values())
        chunk: int | None = chunk_bytes or (DEVICE_CHUNK_BYTES if on_device else DEFAULT_CHUNK_BYTES)
        workers: int | None = opened.reads.connections
        if opened.local():  # every file from its copy (cache_dir): a local load's threads and reads
            workers, chunk = None, chunk_bytes
        filled = fill_parts(opened.parts, tensors, strict=strict, threads=workers,
                            chunk_bytes=chunk, gpu_path=gpu_path, source=opened.source,
                            cancel=opened.reads.cancel)  # a failed read ends the others' waits between tries
        opened.commit()
        return filled
