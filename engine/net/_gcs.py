"""Google Cloud Storage on the wire: where ``gs://bucket/key`` lives, the access token, listing.

Private: the GCS side of :mod:`engine.urls._remote_files`.  The engine speaks GCS's XML API
itself (ranged ``GET`` of ``{endpoint}/{bucket}/{key}``, ``GET {endpoint}/{bucket}?prefix=``
to list) over its own keep-alive connections, with the retries of every request
(:mod:`engine.net.retry`: GCS's 429 and 5xx are transient):

* endpoint: ``STORAGE_EMULATOR_HOST`` (an emulator, a test server; ``http://`` where it names
  no scheme), else ``https://storage.googleapis.com``;
* credentials, the first found: an access token from the environment
  (``GOOGLE_OAUTH_ACCESS_TOKEN``, else ``CLOUDSDK_AUTH_ACCESS_TOKEN``, the one gcloud takes);
  else the file ``GOOGLE_APPLICATION_CREDENTIALS`` names or gcloud's application default
  credentials (``~/.config/gcloud/application_default_credentials.json``): a user's refresh
  token (``authorized_user``) is exchanged for an access token at its ``token_uri``, a service
  account's key (``service_account``) signs a JWT for one (RS256, with the ``cryptography``
  package); else, on Google's machines (``GCE_METADATA_HOST``, or a DMI product name of
  ``Google``), the metadata server's token.  None: anonymous requests (public buckets).
  Tokens are refreshed a minute before they expire.

The token never leaves this module except inside the ``Authorization`` header of a request
to the endpoint's host.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from typing import Any

from engine.errors import MissingDependencyError, ReadError

__all__ = ["GcsConfig", "split_gs_url", "parse_listing"]

_DEFAULT_ENDPOINT = "https://storage.googleapis.com"
_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
_REFRESH_EARLY_S = 60.0
_TOKEN_TIMEOUT_S = 30.0


def split_gs_url(url: str) -> tuple[str, str]:
    """``(bucket, key)`` of ``gs://bucket/key``; the key may be empty (the bucket's root)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("gs", "gcs") or not parts.netloc:
        raise ReadError(f"{url!r} is not a gs://bucket/key URL", reason="InvalidURL", path=url)
    return parts.netloc, urllib.parse.unquote(parts.path.lstrip("/"))


def _endpoint() -> str:
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if not host:
        return _DEFAULT_ENDPOINT
    return (host if "://" in host else f"http://{host}").rstrip("/")


def _post_token(url: str, form: Mapping[str, str], what: str, headers: Mapping[str, str] | None = None,
                method: str = "POST") -> tuple[str, float]:
    """``(access token, seconds it lives)`` from an OAuth token endpoint (or the metadata
    server, ``method="GET"``)."""
    data = urllib.parse.urlencode(form).encode() if method == "POST" else None
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=_TOKEN_TIMEOUT_S) as resp:
            body = json.loads(resp.read(1 << 20))
    except urllib.error.HTTPError as exc:
        raise ReadError(f"{what} refused to give an access token (HTTP {exc.code})", reason="AccessDenied",
                        path=url) from None
    except (OSError, ValueError) as exc:
        raise ReadError(f"{what} gave no access token: {exc}", reason="ConnectionError", path=url) from None
    token = body.get("access_token") if isinstance(body, dict) else None
    if not isinstance(token, str) or not token:
        raise ReadError(f"{what} answered without an access token", reason="AccessDenied", path=url)
    expires = body.get("expires_in", 3600)
    return token, float(expires) if isinstance(expires, (int, float)) else 3600.0


def _jwt(info: Mapping[str, Any], audience: str) -> str:
    """A service account's signed assertion (RS256) for a read-only storage token."""
    try:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding
    except ImportError:
        raise MissingDependencyError("cryptography", "gcs", "signing a service account's token request") from None

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")

    now = int(time.time())
    head = {"alg": "RS256", "typ": "JWT"}
    if info.get("private_key_id"):
        head["kid"] = str(info["private_key_id"])
    claims = {"iss": info["client_email"], "scope": _SCOPE, "aud": audience, "iat": now, "exp": now + 3600}
    signing = f"{b64(json.dumps(head).encode())}.{b64(json.dumps(claims).encode())}"
    key: Any = serialization.load_pem_private_key(str(info["private_key"]).encode(), password=None)
    signature = key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing}.{b64(signature)}"


def _on_google() -> bool:
    try:
        with open("/sys/class/dmi/id/product_name") as f:
            return "Google" in f.read(256)
    except OSError:
        return False


def _credentials_file() -> str | None:
    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if path:
        return os.path.expanduser(path)
    config = os.environ.get("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    adc = os.path.join(config, "application_default_credentials.json")
    return adc if os.path.isfile(adc) else None


def _token_source() -> tuple[str, Callable[[], tuple[str, float]]] | None:
    """What gives this environment's access token: ``(how, fetch)``, ``fetch() -> (token,
    seconds it lives)``; ``None``: anonymous."""
    for name in ("GOOGLE_OAUTH_ACCESS_TOKEN", "CLOUDSDK_AUTH_ACCESS_TOKEN"):
        token = os.environ.get(name, "").strip()
        if token:
            return name, lambda token=token: (token, float("inf"))
    path = _credentials_file()
    if path:
        try:
            with open(path, "rb") as f:
                info = json.loads(f.read(1 << 20))
        except (OSError, ValueError) as exc:
            raise ReadError(f"cannot read the Google credentials file: {exc}", reason="AccessDenied",
                            path=path) from None
        kind = info.get("type") if isinstance(info, dict) else None
        if kind == "authorized_user":
            uri = str(info.get("token_uri") or "https://oauth2.googleapis.com/token")
            form = {"grant_type": "refresh_token", "refresh_token": str(info.get("refresh_token", "")),
                    "client_id": str(info.get("client_id", "")), "client_secret": str(info.get("client_secret", ""))}
            return f"the user credentials in {path}", lambda: _post_token(uri, form, "Google's token endpoint")
        if kind == "service_account":
            uri = str(info.get("token_uri") or "https://oauth2.googleapis.com/token")
            return f"the service account {info.get('client_email')!r}", lambda: _post_token(
                uri, {"grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer", "assertion": _jwt(info, uri)},
                "Google's token endpoint")
        raise ReadError(f"the Google credentials file is of type {kind!r}; the engine reads 'authorized_user' "
                        "and 'service_account' (or set GOOGLE_OAUTH_ACCESS_TOKEN)", reason="AccessDenied", path=path)
    host = os.environ.get("GCE_METADATA_HOST", "").strip()
    if host or _on_google():
        url = (f"http://{host or 'metadata.google.internal'}/computeMetadata/v1/instance/service-accounts/"
               "default/token")
        return "the metadata server", lambda: _post_token(url, {}, "the metadata server",
                                                          {"Metadata-Flavor": "Google"}, method="GET")
    return None


class GcsConfig:
    """Where and how to reach GCS for one load: the endpoint and the token.

    Parameters
    ----------
    anonymous : bool, optional
        Send no token (public buckets).  Default: send one where the environment gives one.
    """

    scheme = "gs"

    def __init__(self, *, anonymous: bool = False) -> None:
        self.endpoint = _endpoint()
        self._host = urllib.parse.urlsplit(self.endpoint).netloc
        source = None if anonymous else _token_source()
        self._how = source[0] if source else None
        self._fetch = source[1] if source else None
        self._token: str | None = None
        self._until = 0.0
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the token
        return f"GcsConfig(endpoint={self.endpoint!r}, {self._how or 'anonymous'})"

    @property
    def signed(self) -> bool:
        return self._fetch is not None

    def http_url(self, bucket: str, key: str, query: str = "") -> str:
        """The http(s) URL of ``key`` in ``bucket`` (``key`` may be empty: the bucket)."""
        path = f"/{urllib.parse.quote(bucket, safe='')}/{urllib.parse.quote(key, safe='/~')}"
        parts = urllib.parse.urlsplit(self.endpoint)
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + path, query, ""))

    def headers(self, url: str, request: Mapping[str, str] | None = None) -> dict[str, str]:
        """The ``Authorization`` of a request to ``url`` (nothing for another host, nothing when anonymous)."""
        if self._fetch is None or urllib.parse.urlsplit(url).netloc != self._host:
            return {}
        now = time.monotonic()
        with self._lock:
            if self._token is None or now >= self._until:
                token, lives = self._fetch()
                self._token, self._until = token, now + max(0.0, lives - _REFRESH_EARLY_S)
            return {"Authorization": f"Bearer {self._token}"}

    def list_url(self, bucket: str, prefix: str, token: str | None) -> str:
        query: dict[str, str] = {"prefix": prefix}
        if token:
            query["marker"] = token
        return self.http_url(bucket, "", urllib.parse.urlencode(sorted(query.items()), quote_via=urllib.parse.quote))

    @staticmethod
    def parse_listing(body: bytes) -> tuple[list[tuple[str, int]], str | None]:
        return parse_listing(body)


def parse_listing(body: bytes) -> tuple[list[tuple[str, int]], str | None]:
    """``([(key, size), ...], the marker of the next page or None)`` of a GCS XML listing
    (``ListBucketResult``: ``NextMarker``, else the last key, while ``IsTruncated``)."""
    root = ET.fromstring(body)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    keys = [(item.findtext(f"{ns}Key") or "", int(item.findtext(f"{ns}Size") or "0"))
            for item in root.iter(f"{ns}Contents")]
    truncated = (root.findtext(f"{ns}IsTruncated") or "").strip().lower() == "true"
    if not truncated:
        return keys, None
    marker = root.findtext(f"{ns}NextMarker") or (keys[-1][0] if keys else None)
    return keys, marker
