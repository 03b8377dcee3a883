"""A remote file as the client knows it: where it is, how it is named in messages, its size
and version.

:class:`RemoteFile` is what a file's first request saw (:meth:`engine.net.remote_reads.RangeReads.first`)
and what every later request of the file is checked against; :func:`public_url` is its URL
without a ``user:password@`` part, the name errors use, so that no credential appears in one.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["RemoteFile", "public_url"]


class RemoteFile(NamedTuple):
    """A remote file as its header request saw it: where it ended up after redirects, its
    size, its ETag (``None`` where the server sends none), the URL to name in errors, and
    the headers to send there (``None``: the load's own; a redirect to another host has
    dropped the credentials from them)."""

    url: str
    size: int
    etag: str | None = None
    name: str | None = None
    headers: Mapping[str, str] | None = None


def public_url(url: str) -> str:
    """``url`` without a ``user:password@`` part (for messages)."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - a malformed host or port raises here
    except ValueError:  # malformed: cut whatever stands before an @ in the authority
        return re.sub(r"//[^/@]*@", "//", url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address keeps its brackets
        host = f"[{host}]"
    if parts.port:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
