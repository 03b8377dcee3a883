"""S3 on the wire: where ``s3://bucket/key`` lives, SigV4 request signing, and listing.

Private: the S3 side of :mod:`engine.net.remote_reads` and :mod:`engine.urls.remote`.  The engine
speaks the S3 REST API itself (ranged ``GET``, ``ListObjectsV2``) over its own keep-alive
connections, so tensor bytes go from the socket straight into their destination; only the
credentials, the configuration and the SigV4 signature come from ``botocore``, imported on
first use, so that everything boto users set applies:

* credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
  ``AWS_PROFILE`` and the shared files (``~/.aws/credentials``, ``~/.aws/config``), SSO,
  container and instance roles: botocore's own chain.  No credentials (or
  ``anonymous=True``, or ``AWS_NO_SIGN_REQUEST``): unsigned requests, for public buckets.
* region: ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / the profile's ``region``, else
  ``us-east-1``;
* endpoint: ``endpoint_url=``, ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (an
  S3-compatible server: MinIO, Ceph, R2, a local test server), else AWS's regional endpoint.
  A custom endpoint is addressed path-style (``http://host/bucket/key``), AWS itself
  virtual-hosted (``https://bucket.s3.region.amazonaws.com/key``) unless the bucket name
  has dots.

Secrets never leave this module except inside the ``Authorization`` header of a request:
no message, ``repr`` or log line holds them.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Any

from engine.errors import MissingDependencyError, ReadError

__all__ = ["S3Config", "split_s3_url", "parse_listing"]

_SIGNATURE_REUSE_S = 240.0  # a SigV4 signature is accepted for 15 minutes; re-sign well before


def split_s3_url(url: str) -> tuple[str, str]:
    """``(bucket, key)`` of ``s3://bucket/key``; the key may be empty (the bucket's root)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "s3" or not parts.netloc:
        raise ReadError(f"{url!r} is not an s3://bucket/key URL", reason="InvalidURL", path=url)
    return parts.netloc, urllib.parse.unquote(parts.path.lstrip("/"))


def _botocore():
    try:
        import botocore.auth
        import botocore.awsrequest
        import botocore.session
    except ImportError:
        raise MissingDependencyError("botocore", "s3", "reading s3:// URLs") from None
    return botocore


class S3Config:
    """Where and how to reach S3 for one load: endpoint, region, addressing and signing.

    Parameters
    ----------
    endpoint_url : str, optional
        An S3-compatible server; default from the environment or AWS.
    region : str, optional
    profile : str, optional
        A profile of the shared AWS files.
    anonymous : bool, optional
        Sign nothing (public buckets).  Default: sign when credentials are found.
    """

    def __init__(self, *, endpoint_url: str | None = None, region: str | None = None,
                 profile: str | None = None, anonymous: bool | None = None) -> None:
        if anonymous is None:
            anonymous = os.environ.get("AWS_NO_SIGN_REQUEST", "").lower() in ("1", "true", "yes")
        session = None
        if not anonymous:
            botocore = _botocore()
            self._botocore = botocore
            session = botocore.session.Session(profile=profile)
        env_region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        self.region = region or (session.get_config_variable("region") if session else env_region) or "us-east-1"
        endpoint = (endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                    or (_config_endpoint(session) if session else None))
        self.custom_endpoint = bool(endpoint)
        self.endpoint = (endpoint or f"https://s3.{self.region}.amazonaws.com").rstrip("/")
        # anonymous requests need no botocore at all (public buckets, a short-lived tool)
        self._credentials = session.get_credentials() if session is not None else None
        self._signed: dict[str, tuple[float, dict[str, str]]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the credentials
        how = "signed" if self._credentials is not None else "anonymous"
        return f"S3Config(endpoint={self.endpoint!r}, region={self.region!r}, {how})"

    @property
    def signed(self) -> bool:
        return self._credentials is not None

    def http_url(self, bucket: str, key: str, query: str = "") -> str:
        """The http(s) URL of ``key`` in ``bucket`` (``key`` may be empty: the bucket)."""
        quoted = urllib.parse.quote(key, safe="/~")
        parts = urllib.parse.urlsplit(self.endpoint)
        if self.custom_endpoint or "." in bucket:
            path = f"{parts.path.rstrip('/')}/{bucket}/{quoted}"
            netloc = parts.netloc
        else:
            path = f"{parts.path.rstrip('/')}/{quoted}"
            netloc = f"{bucket}.{parts.netloc}"
        return urllib.parse.urlunsplit((parts.scheme, netloc, path, query, ""))

    scheme = "s3"

    def headers(self, url: str, request: Mapping[str, str] | None = None) -> dict[str, str]:
        """Headers that sign a ``GET`` of ``url`` (empty when anonymous).  ``Range`` and
        ``If-Match`` (among the ``request``'s headers) stay outside the signature, so one
        signature serves every range of a file for a few minutes."""
        if self._credentials is None:
            return {}
        now = time.monotonic()
        with self._lock:
            hit = self._signed.get(url)
            if hit is not None and now - hit[0] < _SIGNATURE_REUSE_S:
                return hit[1]
        botocore = self._botocore
        aws = botocore.awsrequest.AWSRequest(method="GET", url=url, headers={})
        creds = self._credentials.get_frozen_credentials()  # refreshes temporary credentials
        botocore.auth.S3SigV4Auth(creds, "s3", self.region).add_auth(aws)
        signed = {k: v for k, v in aws.headers.items()}
        with self._lock:
            if len(self._signed) > 4096:
                self._signed.clear()
            self._signed[url] = (now, signed)
        return signed

    def list_url(self, bucket: str, prefix: str, token: str | None) -> str:
        query: dict[str, str] = {"list-type": "2", "prefix": prefix}
        if token:
            query["continuation-token"] = token
        return self.http_url(bucket, "", urllib.parse.urlencode(sorted(query.items()), quote_via=urllib.parse.quote))

    @staticmethod
    def parse_listing(body: bytes) -> tuple[list[tuple[str, int]], str | None]:
        return parse_listing(body)


def parse_listing(body: bytes) -> tuple[list[tuple[str, int]], str | None]:
    """``([(key, size), ...], next continuation token or None)`` of a ListObjectsV2 answer."""
    root = ET.fromstring(body)
    ns = ""
    if root.tag.startswith("{"):
        ns = root.tag[: root.tag.index("}") + 1]
    keys = []
    for item in root.iter(f"{ns}Contents"):
        key = item.findtext(f"{ns}Key") or ""
        size = item.findtext(f"{ns}Size") or "0"
        keys.append((key, int(size)))
    truncated = (root.findtext(f"{ns}IsTruncated") or "").strip().lower() == "true"
    token = root.findtext(f"{ns}NextContinuationToken") if truncated else None
    return keys, token


def _config_endpoint(session: Any) -> str | None:
    """``endpoint_url`` of the profile's ``s3`` section or of the profile (the shared config
    file's service-specific endpoints, as botocore reads them)."""
    try:
        profile: Mapping[str, Any] = session.get_scoped_config()
    except Exception:  # a profile that does not exist is botocore's to report at signing
        return None
    s3 = profile.get("s3")
    if isinstance(s3, Mapping) and s3.get("endpoint_url"):
        return str(s3["endpoint_url"])
    value = profile.get("endpoint_url")
    return str(value) if value else None
