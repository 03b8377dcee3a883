"""Where a remote checkpoint's files are and how their headers are read: HTTP, S3, fsspec.

Shared by :mod:`engine.urls.remote` (headers, single tensors) and :mod:`engine.urls.remote_load`
(whole loads).  A :class:`RemoteSource` is made from one URL and knows its transport:

``http://``, ``https://``
    :mod:`engine.net._http` (exact request counts, one deadline per call).
``s3://bucket/key``
    The same client, each request signed by :class:`engine.net._s3.S3Config` (botocore's
    credentials, region and endpoint; anonymous when there are none).
any other fsspec protocol
    Through :mod:`fsspec` (the ``remote`` extra).

The header of a file costs two ranged GETs (its length, then the header); an index one GET;
an S3 prefix one ``ListObjectsV2`` per 1000 keys.
"""

from __future__ import annotations

import email.utils
import posixpath
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.base._files import is_url
from engine.base._threads import map_threads
from engine.checkpoints.checkpoint_info import CheckpointInfo
from engine.errors import (
    CheckpointIndexError,
    HeaderError,
    MissingDependencyError,
    MissingShardError,
    ReadError,
    RemoteFileNotFoundError,
    SafetensorError,
)
from engine.format.checkpoint_index import index_problems, parse_index
from engine.format.header import Header, checked_length, parse_header
from engine.net._http import Client, Response, read_error, unreachable
from engine.net._s3 import S3Config, parse_listing, split_s3_url
from engine.net.remote_reads import RangeReads, RemoteFile, Retry, public_url, transient

__all__ = ["RemoteSource", "is_index", "is_url", "checkpoint_info", "INDEX_NAME", "SINGLE_NAME"]

#: What a prefix (``.../``) is looked up as, in this order: the index, then one file.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


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


def _http_header(http: Client, url: str, max_header_size: int, not_found=None, etags=None, raws=None,
                 modified=None, bodies=None, dates=None) -> Header:
    """Two ranged GETs (one if the server ignores Range): the length, then the header.
    ``etags``, a dict, receives ``url -> ETag`` (or ``None``) of the first answer, ``modified``
    its ``Last-Modified`` and ``dates`` its ``Date`` (this machine's clock where the server
    sends none); ``raws`` ``url -> `` the file's first ``8 + N`` bytes as received
    (for a local copy, :mod:`engine.urls.remote_cache`); ``bodies``, where the server ignored
    Range, ``url -> `` the whole-file :class:`~engine.net._http.Response`, read up to the end
    of the header and kept open, for the tensor reads to go on with (no second whole-file
    request)."""
    with http.open(url, 0, 7, not_found=not_found) as r:
        if etags is not None:
            etags[url] = r.etag
        if modified is not None:
            modified[url] = r.last_modified
        if dates is not None:
            dates[url] = r.date or email.utils.formatdate(time.time(), usegmt=True)
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
            # the server ignored Range: keep reading this body for the header, then hand it
            # on to the bulk reads (bodies) or hang up
            body = r.read_exact(n)
            if raws is not None:
                raws[url] = prefix + bytes(body)
            header = _parse(body, total, n, url)
            if bodies is not None:
                r.keep_open()
                bodies[url] = r
            return header
    if n == 0:
        if raws is not None:
            raws[url] = prefix
        return _parse(b"", total, n, url)
    with http.open(url, 8, 7 + n) as r:
        if r.partial:
            if r.first != 8 or r.last != 7 + n:
                raise read_error(f"asked for bytes 8-{7 + n}, the server sent {r.first}-{r.last}", url, "BadRange")
        else:
            r.skip(8)
        if (r.total is not None and r.total != total) or (
            etags is not None and r.etag and etags.get(url) and r.etag != etags[url]
        ) or (modified is not None and r.last_modified and modified.get(url) and r.last_modified != modified[url]):
            raise read_error(
                f"the file changed between two requests ({total} bytes, then {r.total})", url, "FileChanged"
            )
        body = r.read_exact(n)
        if raws is not None:
            raws[url] = prefix + bytes(body)
        return _parse(body, total, n, url)


def _http_range_into(http: Client, url: str, offset: int, view: memoryview, total: int, kept=None) -> None:
    """``view`` from ``offset``: one ranged GET, or the rest of ``kept``, the whole-file
    answer of the header's request (a server that ignores Range), when it has not passed
    ``offset``."""
    if kept is not None:
        try:
            if kept.pos <= offset:
                kept.skip(offset - kept.pos)
                kept.readinto(view)
                return
        finally:
            kept.close(force=True)
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
        Transient failures of the header, index and listing requests are retried so
        (default: not retried).
    keep_bodies : bool
        Where a server ignores Range, keep each file's whole-file answer open after its
        header for the tensor reads to go on with (:meth:`ranges`, :meth:`read_into`);
        :meth:`close` hangs up on those not used.  Otherwise the header's read hangs up.

    Locations (``where``) are what the transport requests: an http(s) URL (also for S3,
    signed on each request) or an fsspec path; :meth:`display` turns one back into the URL
    the user knows, for messages.
    """

    def __init__(self, url: str, *, headers, timeout, max_redirects, storage_options,
                 s3: Mapping[str, Any] | None = None, retry: Retry | None = None,
                 keep_bodies: bool = False) -> None:
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
        # location -> the whole-file answer of a server that ignores Range, kept open
        self.bodies: dict[str, Response] | None = {} if keep_bodies else None
        self.s3: S3Config | None = None
        self.fs: _Fs | None = None
        self.http: Client | None = None
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme in ("http", "https"):
            self.http = Client(headers, timeout, max_redirects)
            self.root = url
        elif scheme == "s3" and not storage_options:
            self.bucket, self.key = split_s3_url(url)
            self.s3 = S3Config(**dict(s3 or {}))
            self.http = Client(headers, timeout, max_redirects, sign=self.s3.headers)
            self.root = self.s3.http_url(self.bucket, self.key)
        elif len(scheme) > 1:
            self.fs = _Fs(url, storage_options)
            self.root = self.fs.root
        else:
            raise ReadError(f"{url!r} is not a URL (expected http(s)://, s3:// or an fsspec protocol)",
                            reason="InvalidURL")

    def display(self, where: str) -> str:
        """The URL a user would write for a location."""
        if self.s3 is not None:
            prefix = self.s3.http_url(self.bucket, "")
            if where.startswith(prefix):
                return f"s3://{self.bucket}/{urllib.parse.unquote(where[len(prefix):])}"
        if self.fs is not None:
            return self.fs.url(where)
        return public_url(where)  # a user:password part is for the server, never for messages

    def _named(self, where: str, fn: Callable[[], Any]):
        """Errors name the user's URL (an S3 location is an http URL on the wire).  With a
        ``retry``, a transient failure (:func:`~engine.net.remote_reads.transient`; not a
        timeout: the call's one deadline has passed) is tried again, ``fn`` from its start.
        A refused connection or a name that does not resolve is not: these requests are the
        call's first contact with the server, and no server answered (see
        :func:`engine.net._http.unreachable`)."""
        attempt = 0
        while True:
            try:
                return fn()
            except SafetensorError as err:
                attempt += 1
                if (self.retry is not None and attempt < self.retry.attempts and err.reason != "Timeout"
                        and transient(err) and not unreachable(err)):
                    time.sleep(self.retry.delay(attempt))
                    continue
                if isinstance(err.path, str) and err.path == where:
                    err.path = self.display(where)
                raise

    def shard(self, name: str) -> str:
        """Location of a shard named by the index (the name is already checked as safe)."""
        if self.s3 is not None:
            key = posixpath.join(posixpath.dirname(self.key), name)
            return self.s3.http_url(self.bucket, key)
        if self.http is not None:
            return urllib.parse.urljoin(self.url, urllib.parse.quote(name, safe="/"))
        assert self.fs is not None
        return posixpath.join(posixpath.dirname(self.fs.root), name)

    def header(self, where: str, max_header_size: int, *, shard: bool = False) -> Header:
        if where in self._probed:
            return self._probed.pop(where)
        not_found = MissingShardError if shard else None
        if self.http is not None:
            http = self.http
            return self._named(where, lambda: _http_header(http, where, max_header_size, not_found, self.etags,
                                                           self.raw_headers, self.last_modified, self.bodies,
                                                           self.dates))
        assert self.fs is not None
        return self.fs.header(where, max_header_size, not_found)

    def index(self, max_size: int, where: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
        where = where or self.root
        if where in self._probed:
            return self._probed.pop(where)
        if self.http is not None:
            http = self.http

            def get() -> bytes:
                with http.open(where) as r:
                    return r.read_all(max_size, "the index")

            data = self._named(where, get)
        else:
            assert self.fs is not None
            data = self.fs.read_all(where, max_size, "the index")
        return parse_index(data, source=self.display(where))

    def read_into(self, where: str, offset: int, view: memoryview, total: int) -> None:
        if not len(view):
            return
        if self.http is not None:
            http = self.http
            kept = self.bodies.pop(where, None) if self.bodies is not None else None
            self._named(where, lambda: _http_range_into(http, where, offset, view, total, kept))
        else:
            assert self.fs is not None
            view[:] = self.fs.read(where, offset, len(view))

    def close(self) -> None:
        """Hang up on the whole-file answers no read took over."""
        if self.bodies:
            for r in self.bodies.values():
                r.close(force=True)
            self.bodies.clear()

    # -- what a URL holds ----------------------------------------------------------------

    def layout(self, max_size: int) -> tuple[str, list[str]]:
        """What the URL names: ``("file", [location])``, ``("index", [location])`` or, for
        a prefix, whichever of :data:`INDEX_NAME` / :data:`SINGLE_NAME` it holds (an S3
        prefix also: every ``.safetensors`` right under it, as one checkpoint)."""
        if self.s3 is not None:
            if self.key.endswith(".json"):
                return "index", [self.root]
            if self.key.endswith(".safetensors"):
                return "file", [self.root]
            return self._s3_prefix(max_size)
        path = urllib.parse.urlsplit(self.url).path if self.http is not None else self.root
        if is_index(self.url):
            return "index", [self.root]
        if not path.endswith("/"):
            if self.http is None or path.endswith(".safetensors"):
                return "file", [self.root]
            return self._file_or_folder(max_size)
        return self._folder(max_size)

    def _file_or_folder(self, max_size: int) -> tuple[str, list[str]]:
        """An http(s) URL that names neither a ``.safetensors`` file nor a folder (no slash):
        read as a file, unless the server redirects it to itself plus ``/`` or answers an
        HTML page (a folder's listing): then it is read as that folder."""
        assert self.http is not None
        url = self.root
        try:
            # kept for the caller's own request of the same thing (no second fetch)
            self._probed[url] = self.header(url, max_size)
            return "file", [url]
        except (HeaderError, ReadError) as err:
            moved = self.http.moved.get(url)
            html = "html" in (self.http.content_types.get(url) or "").lower()
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
        if self.http is not None:
            return urllib.parse.urljoin(self.url, name)
        assert self.fs is not None
        return posixpath.join(self.root, name)

    def _s3_prefix(self, max_size: int) -> tuple[str, list[str]]:
        assert self.s3 is not None and self.http is not None
        prefix = self.key if not self.key or self.key.endswith("/") else self.key + "/"
        keys: list[str] = []
        token: str | None = None
        http = self.http
        for _ in range(1000):  # 1000 pages of 1000 keys
            where = self.s3.list_url(self.bucket, prefix, token)

            def page(where=where) -> bytes:
                with http.open(where) as r:
                    return r.read_all(64 << 20, "the listing")

            body = self._named(where, page)
            try:
                found, token = parse_listing(body)
            except Exception as exc:  # an S3-compatible server that answers something else
                raise read_error(f"the listing is not S3 XML: {exc}", self.url, "HTTPError") from None
            keys += [k for k, _ in found if "/" not in k[len(prefix):]]
            if not token:
                break
        if prefix + INDEX_NAME in keys:
            return "index", [self.s3.http_url(self.bucket, prefix + INDEX_NAME)]
        files = sorted(k for k in keys if k.endswith(".safetensors"))
        if not files:
            raise RemoteFileNotFoundError(f"no .safetensors file and no {INDEX_NAME} under this prefix",
                                          path=self.url)
        return ("file" if len(files) == 1 else "files"), [self.s3.http_url(self.bucket, k) for k in files]

    # -- bulk reads ----------------------------------------------------------------------

    def ranges(self, where: str, header: Header, reads: RangeReads) -> Callable[[int, Sequence[memoryview]], None]:
        """``read(offset, views)`` for the bulk reads of one file of a load."""
        if self.http is not None:
            # where the header's requests ended after redirects, with the headers sent there
            final, headers = self.http.resolved.get(where, (where, None))
            file = RemoteFile(final, header.file_size, self.etags.get(where), self.display(where), headers)
            kept = self.bodies.pop(where, None) if self.bodies is not None else None
            if kept is not None:  # the server ignored Range: the bulk reads go on with this answer
                reads.adopt(file, *kept.detach(), kept.pos)
            return reads.reader(file)
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
