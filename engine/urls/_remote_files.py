"""Where a remote checkpoint's files are and how their headers are read: HTTP, S3, GCS, Azure, the Hub, fsspec.

Shared by :mod:`engine.urls.remote` (headers, single tensors) and :mod:`engine.urls.remote_load`
(whole loads).  A :class:`RemoteSource` is made from one URL and knows its transport:

``http://``, ``https://``
    :class:`engine.net.remote_reads.RangeReads`, the one client of every request (exact
    request counts, each request's deadline, the same retries in every phase).
``s3://bucket/key``
    The same client, each request signed by :class:`engine.net._s3.S3Config` (botocore's
    credentials, region and endpoint; anonymous when there are none).
``gs://bucket/key``, ``az://container/blob`` (and ``https://{account}.blob.core.windows.net/...``)
    The same client, GCS's XML API (:class:`engine.net._gcs.GcsConfig`: a bearer token) and
    Azure's Blob API (:class:`engine.net._azure.AzureConfig`: SharedKey signing, a SAS or a
    bearer token); a prefix is listed as an S3 prefix is.
``hf://org/name[@revision][/path]``
    The same client (:class:`engine.net._hub.Hub`): the revision resolved once to its commit
    (one API request, which also lists the repo's files), every file read at it through its
    resolve URL (redirected to the CDN, the token dropped there); a file of that commit in
    the local Hub cache is read from disk instead (:meth:`RemoteSource.local_path`).
any other fsspec protocol (and the object stores' URLs with ``storage_options``)
    Through :mod:`fsspec` (the ``remote`` extra).

The header of a file costs two ranged GETs (its length, then the header); an index one GET;
an object store's prefix one listing request per page of keys; an hf:// URL one API request.
A header that fails to parse or check is read once more from the server: the same bytes
again are the file's fault (the error says so), other bytes were damaged on the way.
"""

from __future__ import annotations

import email.utils
import os
import posixpath
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.base._files import is_url, open_regular
from engine.base._threads import map_threads
from engine.checkpoints.checkpoint_info import CheckpointInfo
from engine.errors import (
    CheckpointIndexError,
    ChecksumError,
    HeaderError,
    MissingDependencyError,
    MissingShardError,
    ReadError,
    RemoteFileNotFoundError,
)
from engine.format.checkpoint_index import index_problems, parse_index
from engine.format.checksums import REREADS, Checks
from engine.format.header import Header, checked_length, parse_header, read_header_fd
from engine.io.reader import pread_into
from engine.net._http import read_error
from engine.net._s3 import S3Config, split_s3_url
from engine.net.remote_file import public_url
from engine.net.remote_reads import DEFAULT_CONNECTIONS, RangeReads
from engine.net.retry import Retry

__all__ = ["RemoteSource", "is_index", "is_url", "checkpoint_info", "INDEX_NAME", "SINGLE_NAME"]

#: What a prefix (``.../``) is looked up as, in this order: the index, then one file.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


_HUB_SITE = "https://huggingface.co"


def _hub_site(url: str) -> str | None:
    """The ``hf://`` URL of a URL of the Hub's own site (``https://huggingface.co/org/name/...``)."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in ("huggingface.co", "hf.co"):
        return None
    from engine.net._hub import from_hub_url

    return from_hub_url(url)


def _azure_blob(url: str) -> bool:
    """Whether ``url`` is a blob of Azure's (``https://{account}.blob.core.windows.net/container/...``)
    without a SAS of its own in its query: read with the environment's Azure credentials."""
    parts = urllib.parse.urlsplit(url)
    return (parts.hostname or "").endswith(".blob.core.windows.net") and not parts.query and \
        parts.username is None and parts.path.strip("/") != ""


def is_index(url: str) -> bool:
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


def _http_header(reads: RangeReads, url: str, name: str, max_header_size: int, not_found=None):
    """Two ranged GETs (one if the server ignores Range: its answer is read on): the length,
    then the header.  ``(header, first, raw)``: the :class:`~engine.net.remote_reads.First`
    of the file and its first ``8 + N`` bytes as received.  Bytes that fail to parse or
    check are read again (see the module's doc), as a tensor's are: until they pass, or two
    reads agree (the file's own bytes: the error says so), or
    :data:`~engine.format.checksums.REREADS` reads more."""
    try:
        return _http_header_once(reads, url, name, max_header_size, not_found)
    except (HeaderError, ChecksumError) as err:
        raw = getattr(err, "raw", None)
        if raw is None or err.reason == "NotSafetensors" or "html" in (reads.content_types.get(url) or "").lower():
            raise  # another kind of file (a page, an LFS pointer), or no bytes of one: nothing to read again
        seen = {raw}
        for _ in range(REREADS):
            try:
                return _http_header_once(reads, url, name, max_header_size, not_found)
            except (HeaderError, ChecksumError) as again:
                raw = getattr(again, "raw", None)
                if raw is None or raw in seen:
                    if raw is not None:
                        again.message = f"{again.message} (read again from the server: the same bytes twice)"
                        again.args = (again.message,)
                    raise again from None
                seen.add(raw)
                err = again
        raise err


def _http_header_once(reads: RangeReads, url: str, name: str, max_header_size: int, not_found=None):
    first = reads.first(url, name=name, not_found=not_found)
    total = first.file.size
    try:
        n = _length(first.prefix, total, max_header_size, name, first.content_type)
    except HeaderError as err:
        err.raw = first.prefix  # type: ignore[attr-defined]
        raise
    body = bytearray(n)
    if n:
        reads.read(first.file, 8, [memoryview(body)], quiet=True)
    raw = first.prefix + bytes(body)
    try:
        header = _parse(body, total, n, name)
        # a header that records its own checksum is checked here, while it can be read again (and
        # its parsed entry kept for the load's own Checks.of)
        Checks.of(header, name)
        return header, first, raw
    except (HeaderError, ChecksumError) as err:
        err.raw = raw  # type: ignore[union-attr]
        raise


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
        except OSError as exc:  # protocols that connect when the file system is made (ftp, sftp, ...)
            raise read_error(f"cannot reach the server: {exc}", url, "ConnectionError") from None

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



# --------------------------------------------------------------------------- the source


class RemoteSource:
    """One remote checkpoint URL: its transport and how names become locations.

    Parameters
    ----------
    url : str
    headers, timeout, max_redirects, storage_options
        As :func:`engine.urls.remote.read_metadata` takes them.
    s3 : mapping, optional
        ``endpoint_url``, ``region``, ``profile``, ``anonymous`` for ``s3://``
        (:class:`engine.net._s3.S3Config`).
    retry : Retry, optional
        How transient failures of every request are retried (default :class:`Retry`).
    connections : int, optional
        Keep-alive connections per host of the source's client (its :attr:`reads`): the
        worker threads of a load that reads through it.

    Every HTTP(S) and S3 request goes through :attr:`reads`, the one client, which a load
    goes on to read its tensors with (a server that ignores Range: each file's whole-file
    answer is read on, no second whole-file request); :meth:`close` closes it.

    Locations (``where``) are what the transport requests: an http(s) URL (also for S3,
    signed on each request) or an fsspec path; :meth:`display` turns one back into the URL
    the user knows, for messages.
    """

    def __init__(self, url: str, *, headers, timeout, max_redirects, storage_options,
                 s3: Mapping[str, Any] | None = None, retry: Retry | None = None,
                 connections: int | None = None) -> None:
        self.url = url
        try:
            urllib.parse.urlsplit(url).port  # noqa: B018 - a malformed host or port fails here, named
        except ValueError as exc:
            raise read_error(f"invalid URL: {exc}", public_url(url), "InvalidURL") from None
        self.retry = retry
        self._probed: dict[str, Any] = {}  # what layout() read while looking, for the first use
        self.etags: dict[str, str | None] = {}
        self.raw_headers: dict[str, bytes] = {}  # location -> its first 8 + N bytes (HTTP and S3)
        self.last_modified: dict[str, str | None] = {}  # location -> Last-Modified (HTTP and S3)
        self.dates: dict[str, str] = {}  # location -> Date of its header's answer (HTTP and S3)
        self.files: dict[str, Any] = {}  # location -> its RemoteFile (HTTP and S3)
        #: the object store of an s3://, gs:// or az:// URL (engine.net._s3.S3Config, _gcs.GcsConfig, _azure.AzureConfig)
        self.store: Any = None
        self._shown: str | None = None  # how a store's object URLs are shown, when not as scheme://bucket/
        self.hub: Any = None  # engine.net._hub.Hub of an hf:// URL
        self.fs: _Fs | None = None
        self.reads: RangeReads | None = None
        self._local: dict[str, int] = {}  # a local file's path -> its descriptor (read_into, ranges)
        self.documents: dict[str, bytes] = {}  # an hf:// index's location -> its bytes as received
        scheme = urllib.parse.urlsplit(url).scheme.lower()

        def client(sign=None, send=headers) -> RangeReads:
            return RangeReads(connections=connections or DEFAULT_CONNECTIONS, timeout=timeout, retry=retry,
                              headers=send, sign=sign, max_redirects=max_redirects)

        hub_url = _hub_site(url) if scheme == "https" else None
        if scheme == "hf" or hub_url:
            from engine.net._hub import Hub

            # the Hub site's own URL of a repo, a folder or a file: read as that hf:// URL, at the site
            self.hub = Hub(hub_url, headers, endpoint=_HUB_SITE) if hub_url else Hub(url, headers)
            self.reads = client(send=self.hub.headers)
            try:
                if self.hub.offline:  # HF_HUB_OFFLINE: the local Hub cache alone
                    self.hub.resolve_offline()
                else:  # the revision's commit, once: every file is then read at it
                    self.hub.resolve(self._hub_call(lambda: self.reads.document(  # type: ignore[union-attr]
                        self.hub.api_url(), 64 << 20, "the repo's description", name=url), api=True))
            except BaseException:
                self.reads.close()
                raise
            self.root = self.hub.file_url(self.hub.path) if self.hub.path else self.hub.file_url("")
        elif scheme in ("az", "azure") and not storage_options:
            from engine.net._azure import AzureConfig, split_az_url

            self.bucket, self.key = split_az_url(url)
            self.store = AzureConfig(url=url)
            self.reads = client(self.store.headers)
            self.root = self.store.http_url(self.bucket, self.key)
        elif scheme == "https" and _azure_blob(url):
            from engine.net._azure import AzureConfig, split_blob_url

            endpoint, self.bucket, self.key = split_blob_url(url)
            self.store = AzureConfig(endpoint=endpoint, url=url)
            self._shown = f"{endpoint}/{self.bucket}/"
            self.reads = client(self.store.headers)
            self.root = self.store.http_url(self.bucket, self.key)
        elif scheme in ("http", "https"):
            self.reads = client()
            self.root = url
        elif scheme == "s3" and not storage_options:
            self.bucket, self.key = split_s3_url(url)
            self.store = S3Config(**dict(s3 or {}))
            self.reads = client(self.store.headers)
            self.root = self.store.http_url(self.bucket, self.key)
        elif scheme in ("gs", "gcs") and not storage_options:
            from engine.net._gcs import GcsConfig, split_gs_url

            self.bucket, self.key = split_gs_url(url)
            self.store = GcsConfig()
            self.reads = client(self.store.headers)
            self.root = self.store.http_url(self.bucket, self.key)
        elif len(scheme) > 1:
            self.fs = _Fs(url, storage_options)
            self.root = self.fs.root
        else:
            raise ReadError(f"{url!r} is not a URL (expected http(s)://, s3:// or an fsspec protocol)",
                            reason="InvalidURL")

    def _hub_call(self, fn: Callable[[], Any], api: bool = False) -> Any:
        """``fn()``, a request of an hf:// source: access refused is an error that names the
        repo and says how to give a token (:meth:`engine.net._hub.Hub.explain`)."""
        try:
            return fn()
        except ReadError as err:
            raise (self.hub.not_found(err) if api else self.hub.explain(err)) from None

    def local_path(self, where: str) -> str | None:
        """The local file that holds the same bytes as the location (an hf:// file already in
        the local Hub cache at the commit read), or ``None``."""
        if self.hub is None:
            return None
        file = self.hub.file_of(where)
        return self.hub.cached(file) if file is not None else None

    def _online(self, where: str) -> None:
        """With ``HF_HUB_OFFLINE``, a file the local Hub cache does not hold is not found."""
        if self.hub is not None and self.hub.offline:
            raise RemoteFileNotFoundError(
                f"HF_HUB_OFFLINE is set and the local Hub cache holds no {self.hub.file_of(where)} of "
                f"{self.hub.name} (commit {self.hub.sha})", path=self.display(where))

    def local_fd(self, path: str) -> int:
        """A descriptor of the local file ``path`` (see :meth:`local_path`), open until :meth:`close`."""
        fd = self._local.get(path)
        if fd is None:
            fd = self._local[path] = open_regular(path)
        return fd

    def display(self, where: str) -> str:
        """The URL a user would write for a location."""
        if self.hub is not None:
            file = self.hub.file_of(where)
            if file is not None:
                return self.hub.display(file)
        if self.store is not None:
            # an object's URL without its query (an Azure SAS is a secret)
            prefix, bare = self.store.http_url(self.bucket, "").split("?")[0], where.split("?")[0]
            if bare.startswith(prefix):
                return f"{self._shown or f'{self.store.scheme}://{self.bucket}/'}" \
                    f"{urllib.parse.unquote(bare[len(prefix):])}"
        if self.fs is not None:
            return self.fs.url(where)
        return public_url(where)  # a user:password part is for the server, never for messages

    def shard(self, name: str) -> str:
        """Location of a shard named by the index (the name is already checked as safe)."""
        if self.store is not None:
            key = posixpath.join(posixpath.dirname(self.key), name)
            return self.store.http_url(self.bucket, key)
        if self.hub is not None:
            path = self.hub.path
            folder = posixpath.dirname(path) if path.endswith(".json") else path
            return self.hub.file_url(posixpath.join(folder, name))
        if self.reads is not None:
            return urllib.parse.urljoin(self.url, urllib.parse.quote(name, safe="/"))
        assert self.fs is not None
        return posixpath.join(posixpath.dirname(self.fs.root), name)

    def header(self, where: str, max_header_size: int, *, shard: bool = False) -> Header:
        if where in self._probed:
            return self._probed.pop(where)
        not_found = MissingShardError if shard else None
        local = self.local_path(where)
        if local is not None:  # already in the local Hub cache
            return read_header_fd(self.local_fd(local), path=local, max_header_size=max_header_size)
        if self.hub is not None:
            self._online(where)
            return self._hub_call(lambda: self._remote_header(where, max_header_size, not_found))
        return self._remote_header(where, max_header_size, not_found)

    def _remote_header(self, where: str, max_header_size: int, not_found) -> Header:
        if self.reads is not None:
            header, first, raw = _http_header(self.reads, where, self.display(where), max_header_size, not_found)
            self.files[where] = first.file
            self.etags[where] = first.file.etag
            self.last_modified[where] = first.last_modified
            self.dates[where] = first.date or email.utils.formatdate(time.time(), usegmt=True)
            self.raw_headers[where] = raw
            return header
        assert self.fs is not None
        return self.fs.header(where, max_header_size, not_found)

    def index(self, max_size: int, where: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
        where = where or self.root
        if where in self._probed:
            return self._probed.pop(where)
        local = self.local_path(where)
        if local is not None:
            fd = self.local_fd(local)
            size = os.fstat(fd).st_size
            if size > max_size:
                raise CheckpointIndexError(f"the index is {size} bytes, more than the limit of {max_size}",
                                           reason="TooLarge", path=local)
            data = os.pread(fd, size, 0)
        elif self.reads is not None:
            reads = self.reads
            if self.hub is not None:
                self._online(where)
                data = self._hub_call(lambda: reads.document(where, max_size, "the index", name=self.display(where)))
                self.documents[where] = data  # for the local Hub cache (cache_dir="hf")
            else:
                data = reads.document(where, max_size, "the index", name=self.display(where))
        else:
            assert self.fs is not None
            data = self.fs.read_all(where, max_size, "the index")
        return parse_index(data, source=self.display(where))

    def read_into(self, where: str, offset: int, view: memoryview, total: int, fresh: bool = False) -> None:
        """``view`` from ``offset`` of the file at ``where``; ``fresh``: from the server, not
        from what a whole-file stream kept (a read again after a failed checksum)."""
        if not len(view):
            return
        local = self.local_path(where)
        if local is not None:
            pread_into(self.local_fd(local), offset, [view], path=local)
        elif self.reads is not None:
            self.reads.read(self.files[where], offset, [view], fresh=fresh)
        else:
            assert self.fs is not None
            view[:] = self.fs.read(where, offset, len(view))

    def forget(self, where: str) -> None:
        """The file at ``where`` is not read on (a local copy serves it): hang up on its
        whole-file answer, if its server ignores Range."""
        if self.reads is not None:
            self.reads.forget(where)

    def close(self) -> None:
        """Close the client (its idle connections and whole-file answers) and the local files."""
        if self.reads is not None:
            self.reads.close()
        fds, self._local = list(self._local.values()), {}
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> RemoteSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what a URL holds ----------------------------------------------------------------

    def layout(self, max_size: int) -> tuple[str, list[str]]:
        """What the URL names: ``("file", [location])``, ``("index", [location])`` or, for
        a prefix, whichever of :data:`INDEX_NAME` / :data:`SINGLE_NAME` it holds (an S3
        prefix also: every ``.safetensors`` right under it, as one checkpoint)."""
        if self.store is not None:
            if self.key.endswith(".json"):
                return "index", [self.root]
            if self.key.endswith(".safetensors"):
                return "file", [self.root]
            return self._store_prefix(max_size)
        if self.hub is not None:
            if self.hub.path.endswith(".json"):
                return "index", [self.root]
            if self.hub.path.endswith(".safetensors"):
                return "file", [self.root]
            kind, files = self.hub.folder()  # the repo's file list, from the revision's answer
            return kind, [self.hub.file_url(f) for f in files]
        path = urllib.parse.urlsplit(self.url).path if self.reads is not None else self.root
        if is_index(self.url):
            return "index", [self.root]
        if not path.endswith("/"):
            if self.reads is None or path.endswith(".safetensors"):
                return "file", [self.root]
            return self._file_or_folder(max_size)
        return self._folder(max_size)

    def _file_or_folder(self, max_size: int) -> tuple[str, list[str]]:
        """An http(s) URL that names neither a ``.safetensors`` file nor a folder (no slash):
        read as a file, unless the server redirects it to itself plus ``/`` or answers an
        HTML page (a folder's listing): then it is read as that folder."""
        assert self.reads is not None
        url = self.root
        try:
            # kept for the caller's own request of the same thing (no second fetch)
            self._probed[url] = self.header(url, max_size)
            return "file", [url]
        except (HeaderError, ReadError) as err:
            moved = self.reads.moved.get(url)
            html = "html" in (self.reads.content_types.get(url) or "").lower()
            parts = urllib.parse.urlsplit(url)
            slash = urllib.parse.urlunsplit(parts._replace(path=parts.path + "/"))
            if moved is not None and urllib.parse.urlsplit(moved)._replace(query="", fragment="") != \
                    urllib.parse.urlsplit(slash)._replace(query="", fragment=""):
                raise
            if moved is None and not (html and isinstance(err, HeaderError)):
                raise
            why = f"redirects to {public_url(moved)}" if moved is not None else "answers an HTML page"
        self.url = self.root = moved or slash
        try:
            return self._folder(max_size)
        except RemoteFileNotFoundError as err:
            err.message = (f"not a safetensors file (the server {why}: a folder?), and the folder "
                           f"{public_url(self.url)} holds neither {INDEX_NAME} nor {SINGLE_NAME}; name the file, "
                           "the index, or the folder with its trailing '/'")
            err.args = (err.message,)
            err.path = public_url(url)
            raise

    def _folder(self, max_size: int) -> tuple[str, list[str]]:
        """What a folder (``.../``) holds: its index, else its one file."""
        for name, kind in ((INDEX_NAME, "index"), (SINGLE_NAME, "file")):
            where = self.shard_of_prefix(name)
            try:
                # kept for the caller's own request of the same thing (no second fetch)
                self._probed[where] = self.index(max_size, where) if kind == "index" else self.header(where, max_size)
            except RemoteFileNotFoundError:
                continue
            return kind, [where]
        raise RemoteFileNotFoundError(
            f"neither {INDEX_NAME} nor {SINGLE_NAME} under this prefix", path=public_url(self.url)
        )

    def shard_of_prefix(self, name: str) -> str:
        if self.reads is not None:
            return urllib.parse.urljoin(self.url, name)
        assert self.fs is not None
        return posixpath.join(self.root, name)

    def _store_prefix(self, max_size: int) -> tuple[str, list[str]]:
        """What an object store's prefix holds: its index, else every ``.safetensors`` right under it."""
        assert self.store is not None and self.reads is not None
        prefix = self.key if not self.key or self.key.endswith("/") else self.key + "/"
        self.key = prefix  # an index's shards are named from its folder (a prefix without its slash too)
        keys: list[str] = []
        token: str | None = None
        for _ in range(1000):  # 1000 pages of 1000 keys
            where = self.store.list_url(self.bucket, prefix, token)
            body = self.reads.document(where, 64 << 20, "the listing", name=self.url)
            try:
                found, token = self.store.parse_listing(body)
            except Exception as exc:  # a server that answers something else
                raise read_error(f"the listing is not the XML of a listing: {exc}", self.url, "HTTPError") from None
            keys += [k for k, _ in found if "/" not in k[len(prefix):]]
            if not token:
                break
        if prefix + INDEX_NAME in keys:
            return "index", [self.store.http_url(self.bucket, prefix + INDEX_NAME)]
        files = sorted(k for k in keys if k.endswith(".safetensors"))
        if not files:
            raise RemoteFileNotFoundError(f"no .safetensors file and no {INDEX_NAME} under this prefix",
                                          path=self.url)
        return ("file" if len(files) == 1 else "files"), [self.store.http_url(self.bucket, k) for k in files]

    # -- bulk reads ----------------------------------------------------------------------

    def ranges(self, where: str) -> Callable[[int, Sequence[memoryview]], None]:
        """``read(offset, views)`` for the bulk reads of one file of a load (its header read:
        the same client, where its first requests were redirected, and its version)."""
        local = self.local_path(where)
        if local is not None:
            fd, path = self.local_fd(local), local

            def pread(offset: int, views: Sequence[memoryview]) -> None:
                pread_into(fd, offset, views, path=path)

            return pread
        if self.reads is not None:
            return self.reads.reader(self.files[where])
        fs = self.fs
        assert fs is not None

        def read(offset: int, views: Sequence[memoryview]) -> None:
            # fsspec returns bytes: one copy more than the HTTP and S3 paths
            data = memoryview(fs.read(where, offset, sum(len(v) for v in views)))
            pos = 0
            for v in views:
                v[:] = data[pos : pos + len(v)]
                pos += len(v)

        return read


# --------------------------------------------------------------------------- what a URL holds, read


def checkpoint_info(src: RemoteSource, max_header_size: int, max_shards: int,
                    workers: int) -> tuple[CheckpointInfo, list[str]]:
    """The headers of everything ``src``'s URL names, checked as a local checkpoint's are:
    ``(info, locations)``, the locations in the order of ``info.shards``.

    A file, an index or a prefix (:meth:`RemoteSource.layout`); an index's shards and a
    prefix's files are read ``workers`` at a time.  Shared by :func:`engine.urls.remote.read_metadata`
    and :func:`engine.urls.remote_load.open_parts`, so that a URL means the same to both.
    """
    shown = public_url(src.url)  # what errors and the info name: without a user:password part
    kind, wheres = src.layout(max_header_size)
    metadata: dict[str, Any] | None = None
    weight_map: dict[str, str] | None = None
    index_at = None
    if kind == "index":
        index_at = wheres[0]
        metadata, weight_map = src.index(max_header_size, index_at)
        names = sorted(set(weight_map.values()))
        if len(names) > max_shards:
            raise CheckpointIndexError(
                f"the index names {len(names)} shards, more than the limit of {max_shards} (raise max_shards)",
                reason="TooManyShards", path=src.display(index_at),
            )
        wheres = [src.shard(n) for n in names]
    else:
        names = [posixpath.basename(urllib.parse.urlsplit(src.display(w)).path) or shown for w in wheres]
    found = map_threads(lambda w: src.header(w, max_header_size, shard=kind == "index"), wheres,
                        max(1, workers), name="engine-remote")
    by_shard = dict(zip(names, found, strict=True))
    if weight_map is None:
        return CheckpointInfo(shown, by_shard), wheres
    assert index_at is not None
    index = src.display(index_at)
    problems = index_problems(weight_map, by_shard, index)
    if problems:
        raise problems[0]
    return CheckpointInfo(shown, by_shard, index=index, index_metadata=metadata, weight_map=weight_map), wheres
