"""Headers and single tensors of remote checkpoints, with ranged reads.

The way huggingface.js reads a checkpoint on the Hub: one ``Range: bytes=0-7`` request for
the header length (its ``Content-Range: bytes 0-7/TOTAL`` also gives the file size), one
``Range: bytes=8-(7+N)`` request for the header, never a byte of tensor data.  An index URL
(``...index.json``) costs one request for the index, then two per shard, shards fetched
concurrently.  The header bytes go through the same Cython parser and checks as local files
and come back as the same :class:`~engine.header.Header` objects.

Transports:

``http://``, ``https://``
    A small direct client on :mod:`http.client` (standard library; environment proxies apply),
    so the request count is exact: no ``HEAD``, no read-ahead, redirects followed by hand
    (a bounded number; ``Authorization`` is dropped when a redirect leaves the host), and
    one deadline over the whole call (see :mod:`engine._http`).  A server that ignores
    ``Range`` and answers ``200`` with the whole file is read only as far as needed, then
    the connection is closed.
any other fsspec protocol (``s3://``, ``gs://``, ``hf://``, ``memory://``, ``file://`` ...)
    Through :mod:`fsspec` (the ``remote`` extra), imported on first use: the file size from
    ``fs.size``, then ``fs.cat_file`` of each range.  Request counts and timeouts are the
    implementation's (pass ``storage_options``).
"""

from __future__ import annotations

import os
import posixpath
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from ._http import Client, read_error
from .checkpoint import CheckpointInfo, index_problems, parse_index, read_checkpoint_info
from .errors import (
    CheckpointIndexError,
    HeaderError,
    MissingDependencyError,
    MissingShardError,
    ReadError,
    RemoteFileNotFoundError,
    TensorNotFoundError,
)
from .header import MAX_HEADER_SIZE, Header, checked_length, parse_header
from .reader import map_threads

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_MAX_SHARDS",
    "DEFAULT_MAX_REDIRECTS",
    "RemoteFileNotFoundError",
    "read_metadata",
    "read_header",
    "get_tensor",
]

#: Seconds allowed for each request: connecting, every wait for data and the whole body.
DEFAULT_TIMEOUT = 30.0
#: Largest number of shards an index may name.
DEFAULT_MAX_SHARDS = 4096
#: Redirects followed per request (the Hub answers ``/resolve/`` with one or two).
DEFAULT_MAX_REDIRECTS = 5
_MAX_WORKERS = 8


def _is_index(url: str) -> bool:
    return urllib.parse.urlsplit(url).path.endswith(".json")


# --------------------------------------------------------------------------- content checks


def _length(prefix: bytes, total: int, max_header_size: int, url: str, content_type: str | None) -> int:
    """Header length ``N`` from the first bytes, validated; the error names what the body is."""
    try:
        return checked_length(prefix, total, max_header_size, content_type=content_type, remote=True)
    except HeaderError as err:
        err.path = url
        raise


def _parse(buf: bytes | bytearray, total: int, n: int, url: str) -> Header:
    try:
        table = parse_header(buf, total - 8 - n)
    except HeaderError as err:
        err.path = url
        raise
    return Header(table, file_size=total, path=url)


# --------------------------------------------------------------------------- HTTP


def _http_header(http: Client, url: str, max_header_size: int, not_found=None) -> Header:
    """Two ranged GETs (one if the server ignores Range): the length, then the header."""
    with http.open(url, 0, 7, not_found=not_found) as r:
        total = r.total
        if total is None:
            what = "Content-Range total" if r.partial else "Content-Length"
            raise read_error(
                f"the server did not say how large the file is (no {what}); the size is needed to check "
                "the header against the data region",
                url,
                "UnknownSize",
            )
        if r.partial and r.first != 0:
            raise read_error(f"asked for bytes 0-7, the server sent bytes {r.first}-{r.last}", url, "BadRange")
        prefix = bytes(r.read_exact(min(8, total)))
        n = _length(prefix, total, max_header_size, url, r.content_type)
        if not r.partial:
            # the server ignored Range: keep reading this body for the header, then hang up
            return _parse(r.read_exact(n), total, n, url)
    if n == 0:
        return _parse(b"", total, n, url)
    with http.open(url, 8, 7 + n) as r:
        if r.partial:
            if r.first != 8 or r.last != 7 + n:
                raise read_error(f"asked for bytes 8-{7 + n}, the server sent {r.first}-{r.last}", url, "BadRange")
        else:
            r.skip(8)
        if r.total is not None and r.total != total:
            raise read_error(
                f"the file changed between two requests ({total} bytes, then {r.total})", url, "FileChanged"
            )
        return _parse(r.read_exact(n), total, n, url)


def _http_range_into(http: Client, url: str, offset: int, view: memoryview, total: int) -> None:
    with http.open(url, offset, offset + len(view) - 1) as r:
        if r.partial:
            if r.first != offset:
                raise read_error(
                    f"asked for bytes from {offset}, the server sent bytes from {r.first}", url, "BadRange"
                )
        else:
            r.skip(offset)
        if r.total is not None and r.total != total:
            raise read_error(
                f"the file changed since its header was read ({total} bytes, now {r.total})", url, "FileChanged"
            )
        r.readinto(view)


# --------------------------------------------------------------------------- fsspec


def _fsspec():
    try:
        import fsspec
    except ImportError:
        raise MissingDependencyError("fsspec", "remote", "reading remote checkpoints other than http(s)") from None
    return fsspec


class _Fs:
    """Ranged reads through an fsspec file system."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        fsspec = _fsspec()
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except ImportError as exc:
            scheme = urllib.parse.urlsplit(url).scheme
            err = MissingDependencyError(str(getattr(exc, "name", None) or scheme), "remote", f"{scheme}://")
            err.message = f"the {scheme}:// protocol needs an fsspec implementation: {exc}"
            err.args = (err.message,)
            raise err from None
        except ValueError as exc:
            raise read_error(f"fsspec cannot open this URL: {exc}", url, "InvalidURL") from None

    def _call(self, url: str, fn: Callable[[], Any], not_found=None):
        try:
            return fn()
        except FileNotFoundError:
            raise (not_found or RemoteFileNotFoundError)("not found", path=url) from None
        except (OSError, TimeoutError) as exc:
            raise read_error(f"reading failed: {exc}", url, "IoError") from None

    def url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def header(self, path: str, max_header_size: int, not_found=None) -> Header:
        url = self.url(path)
        total = int(self._call(url, lambda: self.fs.size(path), not_found))
        prefix = self.read(path, 0, min(8, total))
        n = _length(prefix, total, max_header_size, url, None)
        return _parse(self.read(path, 8, n), total, n, url)

    def read(self, path: str, offset: int, size: int) -> bytes:
        if size == 0:
            return b""
        url = self.url(path)
        data = self._call(url, lambda: self.fs.cat_file(path, start=offset, end=offset + size))
        if len(data) != size:
            raise read_error(
                f"asked for {size} bytes at offset {offset}, got {len(data)} (truncated?)",
                url,
                "ShortRead",
                offset=offset,
                size=size,
            )
        return data

    def read_all(self, path: str, limit: int, what: str) -> bytes:
        url = self.url(path)
        size = int(self._call(url, lambda: self.fs.size(path)))
        if size > limit:
            raise read_error(f"{what} is {size} bytes, more than the limit of {limit}", url, "TooLarge")
        return self._call(url, lambda: self.fs.cat_file(path))


# --------------------------------------------------------------------------- public


class _Source:
    """One remote checkpoint: the transport and how shard names become locations."""

    def __init__(self, url: str, *, headers, timeout, max_redirects, storage_options) -> None:
        self.url = url
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme in ("http", "https"):
            self.http: Client | None = Client(headers, timeout, max_redirects)
            self.fs: _Fs | None = None
        elif len(scheme) > 1:
            self.http = None
            self.fs = _Fs(url, storage_options)
        else:
            raise ReadError(f"{url!r} is not a URL (expected http(s):// or an fsspec protocol)", reason="InvalidURL")

    def shard(self, name: str) -> str:
        """Location of a shard named by the index (the name is already checked as safe)."""
        if self.http is not None:
            return urllib.parse.urljoin(self.url, urllib.parse.quote(name, safe="/"))
        assert self.fs is not None
        return posixpath.join(posixpath.dirname(self.fs.root), name)

    def header(self, where: str, max_header_size: int, *, shard: bool = False) -> Header:
        not_found = MissingShardError if shard else None
        if self.http is not None:
            return _http_header(self.http, where, max_header_size, not_found)
        assert self.fs is not None
        return self.fs.header(where, max_header_size, not_found)

    def index(self, max_size: int) -> tuple[dict[str, Any], dict[str, str]]:
        if self.http is not None:
            with self.http.open(self.url) as r:
                data = r.read_all(max_size, "the index")
        else:
            assert self.fs is not None
            data = self.fs.read_all(self.fs.root, max_size, "the index")
        return parse_index(data, source=self.url)

    def read_into(self, where: str, offset: int, view: memoryview, total: int) -> None:
        if not len(view):
            return
        if self.http is not None:
            _http_range_into(self.http, where, offset, view, total)
        else:
            assert self.fs is not None
            view[:] = self.fs.read(where, offset, len(view))


def _source(url, headers, timeout, max_redirects, storage_options) -> _Source:
    return _Source(
        os.fspath(url), headers=headers, timeout=timeout, max_redirects=max_redirects, storage_options=storage_options
    )


def read_header(
    url: str,
    *,
    max_header_size: int = MAX_HEADER_SIZE,
    timeout: float = DEFAULT_TIMEOUT,
    headers: Mapping[str, str] | None = None,
    max_redirects: int = DEFAULT_MAX_REDIRECTS,
    storage_options: Mapping[str, Any] | None = None,
) -> Header:
    """The validated header of one remote safetensors file.

    Parameters
    ----------
    url : str
        ``http(s)://`` or any fsspec URL of a ``.safetensors`` file.
    max_header_size, timeout, headers, max_redirects, storage_options
        As for :func:`read_metadata`.

    Returns
    -------
    Header
        ``header.path`` is ``url``; ``file_size`` is the remote file's size.

    Raises
    ------
    As :func:`read_metadata`.

    Notes
    -----
    Over HTTP exactly two requests (one when the server ignores Range), plus any redirects
    of the first; copies of tensor bytes: 0.
    """
    src = _source(url, headers, timeout, max_redirects, storage_options)
    return src.header(src.url if src.http is not None else src.fs.root, max_header_size)  # type: ignore[union-attr]


def read_metadata(
    url: str,
    *,
    max_header_size: int = MAX_HEADER_SIZE,
    max_shards: int = DEFAULT_MAX_SHARDS,
    timeout: float = DEFAULT_TIMEOUT,
    headers: Mapping[str, str] | None = None,
    max_redirects: int = DEFAULT_MAX_REDIRECTS,
    max_workers: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointInfo:
    """Headers of a remote checkpoint, a single file or an index and its shards.

    Parameters
    ----------
    url : str
        ``http(s)://`` or any fsspec URL of a ``.safetensors`` file or of a
        ``*.safetensors.index.json``; a local path is read with
        :func:`engine.checkpoint.read_checkpoint_info`.
    max_header_size : int, optional
        Largest header accepted per file, and largest index, in bytes.
    max_shards : int, default 4096
        Largest number of shards an index may name.
    timeout : float, default 30
        Seconds allowed for the whole call over HTTP: a deadline over every connection,
        request and body, however the server paces its bytes.  A ``ReadError`` with
        ``reason="Timeout"`` says in ``.phase`` where the time ran out (``"connect"``,
        ``"request"``: waiting for the answer, ``"body"``).  Name resolution (DNS) is not
        bounded.  fsspec protocols use their own settings (``storage_options``).
    headers : mapping of str to str, optional
        Extra HTTP request headers, e.g. ``{"Authorization": "Bearer hf_..."}`` for a gated
        repository; dropped on a redirect to another host.
    max_redirects : int, default 5
        Redirects followed per request.
    max_workers : int, optional
        Shards fetched concurrently (default: up to 8).
    storage_options : mapping, optional
        Passed to ``fsspec.core.url_to_fs`` for non-HTTP URLs.

    Returns
    -------
    CheckpointInfo
        ``.headers`` maps shard names to :class:`~engine.header.Header` objects equal to
        those of local parsing (``path`` is the URL); ``.parameters()`` counts elements per
        dtype and in total; ``.weight_map`` and ``.index_metadata`` come from the index.

    Raises
    ------
    HeaderError
        A header breaks a rule of the format, or the body is not safetensors at all (a Git
        LFS pointer, an HTML page, JSON: the message says which).
    CheckpointIndexError
        The index is malformed, names an unsafe shard (``..``, absolute, another URL: shards
        are always fetched next to the index), names more than ``max_shards`` shards, or
        disagrees with the shards.
    RemoteFileNotFoundError, MissingShardError
        HTTP 404/410 for the file or index, or for a shard.  Both are ``FileNotFoundError``.
    ReadError
        ``.reason``: ``Timeout``, ``ConnectionError``, ``AccessDenied`` (401/403),
        ``RangeNotSatisfiable`` (416), ``HTTPError`` (other statuses), ``TooManyRedirects``,
        ``ShortRead`` (a truncated body), ``UnknownSize`` (no ``Content-Range`` total nor
        ``Content-Length``), ``FileChanged``, ``TooLarge``.  ``.path`` is the URL; HTTP
        errors carry ``.status``.
    MissingDependencyError
        A non-HTTP URL without fsspec (``pip install safetensors-engine[remote]``) or
        without the protocol's implementation (``s3fs``, ``gcsfs``, ...).

    Notes
    -----
    HTTP requests: exactly 2 for a file, ``1 + 2 * N`` for an index of ``N`` shards, when
    the server honours ``Range`` and does not redirect; a redirect costs one request more
    for the first request of a file (the second goes straight to where the first ended).
    Copies of tensor bytes: 0; not a byte of tensor data is requested.
    """
    spath = os.fspath(url)
    if len(urllib.parse.urlsplit(spath).scheme) <= 1:  # no scheme, or a Windows drive letter
        return read_checkpoint_info(spath, max_header_size=max_header_size, max_workers=max_workers)
    src = _source(spath, headers, timeout, max_redirects, storage_options)
    if not _is_index(spath):
        root = src.url if src.http is not None else src.fs.root  # type: ignore[union-attr]
        header = src.header(root, max_header_size)
        name = posixpath.basename(urllib.parse.urlsplit(spath).path) or spath
        return CheckpointInfo(spath, {name: header})
    metadata, weight_map = src.index(max_header_size)
    shards = sorted(set(weight_map.values()))
    if len(shards) > max_shards:
        raise CheckpointIndexError(
            f"the index names {len(shards)} shards, more than the limit of {max_shards} (raise max_shards)",
            reason="TooManyShards",
            path=spath,
        )
    results = map_threads(
        lambda s: src.header(src.shard(s), max_header_size, shard=True), shards, max_workers or _MAX_WORKERS,
        name="engine-remote",
    )
    by_shard = dict(zip(shards, results, strict=True))
    problems = index_problems(weight_map, by_shard, spath)
    if problems:
        raise problems[0]
    return CheckpointInfo(spath, by_shard, index=spath, index_metadata=metadata, weight_map=weight_map)


def get_tensor(
    url: str,
    name: str,
    framework: str = "np",
    device: Any = "cpu",
    *,
    max_header_size: int = MAX_HEADER_SIZE,
    timeout: float = DEFAULT_TIMEOUT,
    headers: Mapping[str, str] | None = None,
    max_redirects: int = DEFAULT_MAX_REDIRECTS,
    storage_options: Mapping[str, Any] | None = None,
):
    """One tensor of a remote checkpoint, through a ranged read of just its bytes.

    Parameters
    ----------
    url : str
        A remote ``.safetensors`` file or ``*.safetensors.index.json`` (see
        :func:`read_metadata`).
    name : str
        The tensor.
    framework : {"np", "numpy", "pt", "torch"}
        Kind of tensor returned.
    device : str, int or torch.device, default "cpu"
        For torch, where the tensor goes.
    max_header_size, timeout, headers, max_redirects, storage_options
        As for :func:`read_metadata`; ``timeout`` bounds the whole call, the data request
        included.

    Returns
    -------
    numpy.ndarray or torch.Tensor
        Owned and writable; sub-byte dtypes as packed ``uint8`` as everywhere in the engine.

    Raises
    ------
    TensorNotFoundError
        The checkpoint has no tensor ``name``.
    Everything :func:`read_metadata` raises.

    Notes
    -----
    HTTP requests: 3 for a file (length, header, the tensor's byte range), 4 for an index
    (index, then the length, header and range of the one shard that holds ``name``); a
    0-byte tensor needs no data request.  Copies of tensor bytes: 1 (from the socket into
    the tensor's memory; a CUDA device adds the host-to-device copy).
    """
    from .sinks import get_sink

    sink = get_sink(framework, device)
    spath = os.fspath(url)
    src = _source(spath, headers, timeout, max_redirects, storage_options)
    root = src.url if src.http is not None else src.fs.root  # type: ignore[union-attr]
    where, shard = root, False
    if _is_index(spath):
        _, weight_map = src.index(max_header_size)
        if name not in weight_map:
            raise TensorNotFoundError.for_name(name, list(weight_map), where="checkpoint", path=spath)
        where, shard = src.shard(weight_map[name]), True
    header = src.header(where, max_header_size, shard=shard)
    info = header[name]  # TensorNotFoundError names the file
    begin, end = info.data_offsets
    arr = sink.empty(info.code, info.shape, end - begin)
    src.read_into(where, header.data_start + begin, sink.raw(arr), header.file_size)
    return sink.to_device(arr)
