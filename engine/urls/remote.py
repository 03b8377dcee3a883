"""Headers and single tensors of remote checkpoints, with ranged reads.

The way huggingface.js reads a checkpoint on the Hub: one ``Range: bytes=0-7`` request for
the header length (its ``Content-Range: bytes 0-7/TOTAL`` also gives the file size), one
``Range: bytes=8-(7+N)`` request for the header, never a byte of tensor data.  An index URL
(``...index.json``) costs one request for the index, then two per shard, shards fetched
concurrently.  The header bytes go through the same Cython parser and checks as local files
and come back as the same :class:`~engine.format.header.Header` objects.

Transports:

``http://``, ``https://``
    The engine's one client (:class:`engine.net.remote_reads.RangeReads`, on :mod:`http.client`;
    environment proxies apply), so the request count is exact: no ``HEAD``, no read-ahead,
    redirects followed by hand (a bounded number; ``Authorization`` is dropped when a redirect
    leaves the host), each request within ``timeout``, transient faults retried as in every
    load.  A server that ignores ``Range`` and answers ``200`` with the whole file is read
    only as far as needed, then the connection is closed.
``s3://bucket/key``
    The same client, each request signed with SigV4 by :mod:`engine.net._s3` (botocore's
    credentials, region and endpoint; the ``s3`` extra; anonymous when there are no
    credentials or with ``AWS_NO_SIGN_REQUEST``).  With ``storage_options``, through s3fs.
``gs://bucket/key``, ``az://container/blob``, ``hf://org/name[@revision][/path]``
    The same client: GCS's XML API with a bearer token from the environment
    (:mod:`engine.net._gcs`), Azure's Blob API signed with SharedKey, a SAS or a bearer token
    (:mod:`engine.net._azure`), the Hugging Face Hub's API and resolve URLs, the token from
    ``HF_TOKEN`` or ``huggingface-cli login`` (:mod:`engine.net._hub`).
any other fsspec protocol (``memory://``, ``file://`` ...)
    Through :mod:`fsspec` (the ``remote`` extra), imported on first use: the file size from
    ``fs.size``, then ``fs.cat_file`` of each range.  Request counts and timeouts are the
    implementation's (pass ``storage_options``).

Whole loads of a URL (every tensor, in parallel) are :mod:`engine.urls.remote_load`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from engine.checkpoints.checkpoint import CheckpointInfo, read_checkpoint_info
from engine.errors import (
    ReadError,
    RemoteFileNotFoundError,
    TensorNotFoundError,
)
from engine.format.checksums import Checks, verify_received, verifying
from engine.format.header import MAX_HEADER_SIZE, Header
from engine.net.remote_file import public_url
from engine.net.retry import Retry
from engine.urls._remote_files import RemoteSource, checkpoint_info, is_url

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


def _source(url, headers, timeout, max_redirects, storage_options, retry=None) -> RemoteSource:
    return RemoteSource(
        os.fspath(url), headers=headers, timeout=timeout, max_redirects=max_redirects, storage_options=storage_options,
        retry=retry,
    )


def read_header(
    url: str,
    *,
    max_header_size: int = MAX_HEADER_SIZE,
    timeout: float = DEFAULT_TIMEOUT,
    headers: Mapping[str, str] | None = None,
    max_redirects: int = DEFAULT_MAX_REDIRECTS,
    storage_options: Mapping[str, Any] | None = None,
    retry: Retry | None = None,
) -> Header:
    """The validated header of one remote safetensors file.

    Parameters
    ----------
    url : str
        ``http(s)://``, ``s3://``, ``gs://``, ``az://``, ``hf://`` or any fsspec URL of a
        ``.safetensors`` file.
    max_header_size, timeout, headers, max_redirects, storage_options, retry
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
    with _source(url, headers, timeout, max_redirects, storage_options, retry) as src:
        kind, wheres = src.layout(max_header_size)
        if kind != "file":
            raise ReadError(
                f"this URL holds a checkpoint of several files ({'an index' if kind == 'index' else 'no index'}), "
                "not one file: read its headers with engine.read_checkpoint_info or engine.urls.remote.read_metadata",
                reason="NotAFile", path=public_url(os.fspath(url)),
            )
        return src.header(wheres[0], max_header_size)


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
    retry: Retry | None = None,
) -> CheckpointInfo:
    """Headers of a remote checkpoint, a single file or an index and its shards.

    Parameters
    ----------
    url : str
        ``http(s)://``, ``s3://``, ``gs://``, ``az://`` or any fsspec URL of a ``.safetensors``
        file, of a ``*.safetensors.index.json`` or of a prefix; ``hf://org/name[@revision]``
        of a Hub repo (or a file in it); a local path is read with
        :func:`engine.checkpoints.checkpoint.read_checkpoint_info`.
    max_header_size : int, optional
        Largest header accepted per file, and largest index, in bytes.
    max_shards : int, default 4096
        Largest number of shards an index may name.
    timeout : float, default 30
        Seconds allowed for each HTTP request: connecting, the answer and the whole body,
        however the server paces its bytes (a watchdog shuts a trickling socket down).  A
        request that runs out of time is tried again, as every transient fault is
        (:class:`~engine.net.retry.Retry`); the last try's ``ReadError`` has
        ``reason="Timeout"``.  Name resolution (DNS) is not bounded.  fsspec protocols use
        their own settings (``storage_options``).
    headers : mapping of str to str, optional
        Extra HTTP request headers, e.g. ``{"Authorization": "Bearer hf_..."}`` for a gated
        repository; dropped on a redirect to another host.
    max_redirects : int, default 5
        Redirects followed per request.
    max_workers : int, optional
        Shards fetched concurrently (default: up to 8).
    storage_options : mapping, optional
        Passed to ``fsspec.core.url_to_fs`` for non-HTTP URLs.
    retry : Retry, optional
        How transient faults of every request are tried again (default
        :class:`~engine.net.retry.Retry`: 6 tries, as a load's).

    Returns
    -------
    CheckpointInfo
        ``.headers`` maps shard names to :class:`~engine.format.header.Header` objects equal to
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
        ``s3://`` without botocore, unless anonymous
        (``pip install safetensors-engine[s3]``); another protocol without fsspec
        (``[remote]``) or without its implementation (``gcsfs``, ...).

    Notes
    -----
    HTTP requests: exactly 2 for a file, ``1 + 2 * N`` for an index of ``N`` shards, when
    the server honours ``Range`` and does not redirect; a redirect costs one request more
    for the first request of a file (the second goes straight to where the first ended).
    Copies of tensor bytes: 0; not a byte of tensor data is requested.
    """
    spath = os.fspath(url)
    if not is_url(spath):  # no scheme, or a Windows drive letter
        return read_checkpoint_info(spath, max_header_size=max_header_size, max_workers=max_workers)
    with _source(spath, headers, timeout, max_redirects, storage_options, retry) as src:
        info, _ = checkpoint_info(src, max_header_size, max_shards, max_workers or _MAX_WORKERS)
    return info


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
    retry: Retry | None = None,
):
    """One tensor of a remote checkpoint, through a ranged read of just its bytes.

    Parameters
    ----------
    url : str
        A remote ``.safetensors`` file, ``*.safetensors.index.json``, prefix or Hub repo (see
        :func:`read_metadata`).
    name : str
        The tensor.
    framework : {"np", "numpy", "pt", "torch"}
        Kind of tensor returned.
    device : str, int or torch.device, default "cpu"
        For torch, where the tensor goes.
    max_header_size, timeout, headers, max_redirects, storage_options, retry
        As for :func:`read_metadata`; ``timeout`` bounds each request, the data request
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
    0-byte tensor needs no data request; a prefix or a Hub repo costs its listing (or the
    Hub's API request) more, and, holding several files and no index, the headers of those
    before the one that holds ``name``; a server that ignores Range is asked once per
    file (the header's whole-file answer is read on to the tensor).  Copies of tensor bytes: 1 (from the socket into
    the tensor's memory; a CUDA device adds the host-to-device copy).
    """
    from engine.loading.loader import sink_for

    sink = sink_for(framework, device)
    spath = os.fspath(url)
    # a server that ignores Range: the tensor is read on from the header's answer
    src = _source(spath, headers, timeout, max_redirects, storage_options, retry)
    try:
        # a file, an index, or a prefix or repo holding either (or several files: the first
        # whose header names the tensor)
        kind, wheres = src.layout(max_header_size)
        where, shard = wheres[0], False
        if kind == "index":
            _, weight_map = src.index(max_header_size, where)
            if name not in weight_map:
                raise TensorNotFoundError.for_name(name, list(weight_map), where="checkpoint", path=spath)
            where, shard = src.shard(weight_map[name]), True
        header = None
        if kind == "files":
            for where in wheres:
                header = src.header(where, max_header_size)
                if name in header.names:
                    break
        if header is None:
            header = src.header(where, max_header_size, shard=shard)
        info = header[name]  # TensorNotFoundError names the file
        begin, end = info.data_offsets
        arr = sink.empty(info.code, info.shape, end - begin)
        raw = sink.raw(arr)

        def receive(fresh: bool = False) -> None:
            src.read_into(where, header.data_start + begin, raw, header.file_size, fresh)

        receive()
        # the file's checksum of the tensor, where it records one (a mismatch is read again once)
        checks = Checks.of(header, src.display(where)) if verifying() else None
        verify_received(checks, header.table.index[name], raw, lambda: receive(True))
    finally:
        src.close()
    return sink.to_device(arr)
