"""Azure Blob Storage on the wire: where ``az://container/blob`` lives, SharedKey signing, SAS, listing.

Private: the Azure side of :mod:`engine.urls._remote_files`.  The engine speaks the Blob REST
API itself (ranged ``GET`` of ``{endpoint}/{container}/{blob}``, ``?restype=container&comp=list``
to list) over its own keep-alive connections, with the retries of every request
(:mod:`engine.net.retry`: Azure's ``ServerBusy`` is a 503).  Everything comes from the
environment the Azure tools read:

* the account and endpoint: ``AZURE_STORAGE_CONNECTION_STRING`` (``AccountName``,
  ``BlobEndpoint`` for Azurite and other custom endpoints, ``EndpointSuffix``,
  ``DefaultEndpointsProtocol``; ``UseDevelopmentStorage=true`` for Azurite's defaults), else
  ``AZURE_STORAGE_ACCOUNT`` (``AZURE_STORAGE_ACCOUNT_NAME``) and
  ``https://{account}.blob.core.windows.net``; an ``https://{account}.blob.core.windows.net/...``
  URL names its own;
* the credentials, the first found: the connection string's ``AccountKey`` or
  ``SharedAccessSignature``; ``AZURE_STORAGE_KEY`` (``AZURE_STORAGE_ACCOUNT_KEY``): every
  request signed with SharedKey (HMAC-SHA256 over the request, ``Range`` and ``If-Match``
  included, as the service computes it); ``AZURE_STORAGE_SAS_TOKEN``: the SAS appended to
  each URL's query; ``AZURE_STORAGE_TOKEN``: an OAuth bearer token (``az account
  get-access-token --resource https://storage.azure.com``).  None: anonymous requests
  (public containers).

Secrets never leave this module except inside a request (its ``Authorization`` header, or
its URL for a SAS); the URLs messages name are ``az://`` ones, without a query.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import os
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Mapping

from engine.errors import ReadError

__all__ = ["AzureConfig", "split_az_url", "parse_listing", "string_to_sign", "API_VERSION", "AZURE_HOST"]

#: The Blob service version the requests ask for.
API_VERSION = "2021-08-06"
#: Host names of Azure's blob endpoints: ``{account}.blob.core.windows.net``.
AZURE_HOST = ".blob.core.windows.net"
#: Azurite's well-known development account and key (public; UseDevelopmentStorage=true).
_DEV_ACCOUNT = "devstoreaccount1"
_DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: The headers SharedKey signs by position, before the ``x-ms-`` ones.
_SIGNED = ("Content-Encoding", "Content-Language", "Content-Length", "Content-MD5", "Content-Type", "Date",
           "If-Modified-Since", "If-Match", "If-None-Match", "If-Unmodified-Since", "Range")


def split_az_url(url: str) -> tuple[str, str]:
    """``(container, blob)`` of ``az://container/blob``; the blob may be empty (the container)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("az", "azure") or not parts.netloc:
        raise ReadError(f"{url!r} is not an az://container/blob URL", reason="InvalidURL", path=url)
    return parts.netloc, urllib.parse.unquote(parts.path.lstrip("/"))


def split_blob_url(url: str) -> tuple[str, str, str]:
    """``(endpoint, container, blob)`` of ``https://{account}.blob.core.windows.net/container/blob``."""
    parts = urllib.parse.urlsplit(url)
    container, _, blob = parts.path.lstrip("/").partition("/")
    return f"{parts.scheme}://{parts.netloc}", container, urllib.parse.unquote(blob)


def _connection_string(text: str) -> dict[str, str]:
    out = {}
    for item in text.split(";"):
        key, sep, value = item.strip().partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def string_to_sign(method: str, url: str, headers: Mapping[str, str], account: str) -> str:
    """SharedKey's string to sign of a request (the Blob service's rules, version 2015-02-21 on):
    the method, the standard headers by position (``Content-Length`` empty when 0), the
    ``x-ms-`` headers sorted, then ``/{account}{path}`` and the query's parameters, sorted,
    one ``\\nname:value`` each (names lowercased, values decoded, repeated values joined by
    commas)."""
    lower = {k.lower(): str(v).strip() for k, v in headers.items()}
    standard = []
    for name in _SIGNED:
        value = lower.get(name.lower(), "")
        if name == "Content-Length" and value == "0":
            value = ""
        standard.append(value)
    xms = sorted((k, v) for k, v in lower.items() if k.startswith("x-ms-"))
    parts = urllib.parse.urlsplit(url)
    resource = f"/{account}{parts.path or '/'}"
    query: dict[str, list[str]] = {}
    for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        query.setdefault(name.lower(), []).append(value)
    for name in sorted(query):
        resource += f"\n{name}:{','.join(sorted(query[name]))}"
    return "\n".join([method.upper(), *standard]) + "\n" + "".join(f"{k}:{v}\n" for k, v in xms) + resource


class AzureConfig:
    """Where and how to reach Azure Blob Storage for one load: the account, the endpoint and
    the credentials (see the module doc).

    Parameters
    ----------
    endpoint : str, optional
        ``https://{account}.blob.core.windows.net`` of a URL that names it; default from the
        environment.
    url : str
        The URL being read (for messages).
    """

    scheme = "az"

    def __init__(self, *, endpoint: str | None = None, url: str = "") -> None:
        env = os.environ
        conn = _connection_string(env.get("AZURE_STORAGE_CONNECTION_STRING", ""))
        if conn.get("UseDevelopmentStorage", "").lower() == "true":
            conn = {"AccountName": _DEV_ACCOUNT, "AccountKey": _DEV_KEY,
                    "BlobEndpoint": conn.get("DevelopmentStorageProxyUri", "http://127.0.0.1:10000").rstrip("/")
                    + f"/{_DEV_ACCOUNT}"}
        account = conn.get("AccountName") or env.get("AZURE_STORAGE_ACCOUNT") or env.get("AZURE_STORAGE_ACCOUNT_NAME")
        # the environment's credentials are its account's: a URL that names another reads anonymously
        mine = True
        if endpoint is not None:
            named = (urllib.parse.urlsplit(endpoint).hostname or "").split(".")[0]
            mine = account == named
            account = named
        if not account:
            raise ReadError("az:// URLs need the storage account: set AZURE_STORAGE_ACCOUNT (and a credential) or "
                            "AZURE_STORAGE_CONNECTION_STRING", reason="InvalidURL", path=url)
        self.account = account
        if endpoint is None:
            endpoint = conn.get("BlobEndpoint")
        if endpoint is None:
            scheme = conn.get("DefaultEndpointsProtocol", "https")
            endpoint = f"{scheme}://{account}.blob.{conn.get('EndpointSuffix', 'core.windows.net')}"
        self.endpoint = endpoint.rstrip("/")
        self._host = urllib.parse.urlsplit(self.endpoint).netloc
        # the connection string's own credential first, then the variables'
        key = sas = bearer = None
        if mine:
            key = conn.get("AccountKey") or (None if conn.get("SharedAccessSignature") else
                                             env.get("AZURE_STORAGE_KEY") or env.get("AZURE_STORAGE_ACCOUNT_KEY"))
            sas = conn.get("SharedAccessSignature") or env.get("AZURE_STORAGE_SAS_TOKEN")
            bearer = env.get("AZURE_STORAGE_TOKEN", "").strip() or None
        self._key: bytes | None = None
        self._sas = ""
        self._bearer: str | None = None
        self.how = "anonymous"
        if key:
            try:
                self._key = base64.b64decode(key, validate=True)
            except ValueError:
                raise ReadError("the Azure storage account key is not base64", reason="AccessDenied", path=url) \
                    from None
            self.how = "SharedKey"
        elif sas:
            self._sas = sas.lstrip("?")
            self.how = "SAS"
        elif bearer:
            self._bearer = bearer
            self.how = "bearer token"

    def __repr__(self) -> str:  # never a secret
        return f"AzureConfig(account={self.account!r}, endpoint={self.endpoint!r}, {self.how})"

    @property
    def signed(self) -> bool:
        return self.how != "anonymous"

    def _with_sas(self, query: str) -> str:
        return "&".join(q for q in (query, self._sas) if q)

    def http_url(self, container: str, blob: str, query: str = "") -> str:
        """The http(s) URL of ``blob`` in ``container`` (``blob`` may be empty: the container),
        with the SAS, where there is one, in its query."""
        path = f"/{urllib.parse.quote(container, safe='')}/{urllib.parse.quote(blob, safe='/~')}"
        parts = urllib.parse.urlsplit(self.endpoint)
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + path,
                                        self._with_sas(query), ""))

    def headers(self, url: str, request: Mapping[str, str] | None = None) -> dict[str, str]:
        """The headers that authorize a ``GET`` of ``url`` with the ``request``'s headers (its
        ``Range`` and ``If-Match`` among them): the version always; for SharedKey the date and
        the signature, for a bearer token the token; nothing else for another host."""
        out = {"x-ms-version": API_VERSION}
        if urllib.parse.urlsplit(url).netloc != self._host:
            return out
        if self._key is not None:
            out["x-ms-date"] = email.utils.formatdate(time.time(), usegmt=True)
            text = string_to_sign("GET", url, {**(request or {}), **out}, self.account)
            mac = hmac.new(self._key, text.encode("utf-8"), hashlib.sha256).digest()
            out["Authorization"] = f"SharedKey {self.account}:{base64.b64encode(mac).decode('ascii')}"
        elif self._bearer is not None:
            out["Authorization"] = f"Bearer {self._bearer}"
        return out

    def list_url(self, container: str, prefix: str, token: str | None) -> str:
        query: dict[str, str] = {"restype": "container", "comp": "list", "prefix": prefix}
        if token:
            query["marker"] = token
        path = f"/{urllib.parse.quote(container, safe='')}"
        parts = urllib.parse.urlsplit(self.endpoint)
        encoded = urllib.parse.urlencode(sorted(query.items()), quote_via=urllib.parse.quote)
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + path,
                                        self._with_sas(encoded), ""))

    @staticmethod
    def parse_listing(body: bytes) -> tuple[list[tuple[str, int]], str | None]:
        return parse_listing(body)


def parse_listing(body: bytes) -> tuple[list[tuple[str, int]], str | None]:
    """``([(blob, size), ...], the marker of the next page or None)`` of a List Blobs answer."""
    root = ET.fromstring(body)
    blobs = []
    for blob in root.iter("Blob"):
        size = blob.findtext("Properties/Content-Length") or "0"
        blobs.append((blob.findtext("Name") or "", int(size)))
    marker = (root.findtext("NextMarker") or "").strip()
    return blobs, marker or None
