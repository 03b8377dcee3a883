"""The Hugging Face Hub on the wire: ``hf://`` URLs, the token, a revision's commit, the local cache.

Private: the Hub's side of :mod:`engine.urls._remote_files`.  Every request goes through the
engine's one client (:class:`engine.net.remote_reads.RangeReads`); huggingface_hub's
conventions are the contract, its code is not needed:

* ``hf://org/name[@revision][/path]`` (``hf://datasets/...``, ``hf://spaces/...`` for those
  repo types; a revision with slashes, ``refs/pr/1``, as it stands or percent-encoded), and
  the Hub site's own URLs of a repo, a folder or a file (``https://huggingface.co/org/name``,
  ``.../tree/{rev}/...``, ``.../resolve/{rev}/...``: :func:`from_hub_url`);
* the endpoint: ``HF_ENDPOINT`` (a mirror, a test server), else ``https://huggingface.co``;
* the token: an ``Authorization`` header the caller passes (``headers=``), else ``HF_TOKEN``
  (or the older ``HUGGING_FACE_HUB_TOKEN``), else the token file that ``huggingface-cli
  login`` writes (``HF_TOKEN_PATH``, else ``$HF_HOME/token``); none with
  ``HF_HUB_DISABLE_IMPLICIT_TOKEN``.  It goes to the Hub's host only: the client drops it when
  a redirect leaves that host (the CDN), as huggingface_hub does;
* the revision is resolved once to its commit (``/api/{type}s/{repo}/revision/{rev}``: its
  ``sha`` and the repo's file list), and every file is then read at that commit
  (``/{repo}/resolve/{sha}/{file}``), so that a push during a load cannot mix two;
* the local cache: a file of that commit already under ``HF_HUB_CACHE`` (else
  ``$HF_HOME/hub``; ``HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface``, else
  ``~/.cache/huggingface``), ``models--org--name/snapshots/{sha}/{file}``, is read from disk.
  Nothing is ever written there.  With ``HF_HUB_OFFLINE`` the cache alone is read: the
  revision from its ``refs/``, the files from its snapshot, no request at all.

The token never leaves this module except inside the ``Authorization`` header of a request.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any, NamedTuple

from engine.errors import ReadError, RemoteFileNotFoundError

__all__ = ["HubPath", "Hub", "split_hf_url", "from_hub_url", "hub_home", "hub_cache", "hub_token"]

_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_SHA = re.compile(r"[0-9a-f]{40}")
_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_MAX_FILES = 1 << 20  # names in a repo's listing beyond which the answer is not believed
_DEFAULT_ENDPOINT = "https://huggingface.co"


class HubPath(NamedTuple):
    """What an ``hf://`` URL names: the repo's type (``model``, ``dataset``, ``space``) and
    id, the revision (``None``: the default branch) and a path inside the repo (``""``: its
    top)."""

    repo_type: str
    repo_id: str
    revision: str | None
    path: str


def _invalid(url: str, why: str) -> ReadError:
    return ReadError(f"{url!r} is not an hf://[datasets/|spaces/]org/name[@revision][/path] URL: {why}",
                     reason="InvalidURL", path=url)


def split_hf_url(url: str) -> HubPath:
    """The :class:`HubPath` of ``hf://...``.  A repo id is ``org/name`` or, where the second
    part names a file (``.safetensors``, ``.json``) or there is none, a bare ``name``."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() != "hf" or not sep:
        raise _invalid(url, "not hf://")
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    repo_type = "model"
    first, _, after = rest.partition("/")
    if first in _TYPES and after:
        repo_type, rest = _TYPES[first], after
    parts = rest.split("/")
    revision: str | None = None
    # the repo id: one or two parts, the revision after an '@' in its last
    n = 1 if ("@" in parts[0] or len(parts) == 1 or parts[1].split("@")[0].endswith((".safetensors", ".json"))
              or not parts[1]) else 2
    repo_parts = parts[:n]
    rest_parts = parts[n:]
    last, at, rev = repo_parts[-1].partition("@")
    repo_parts[-1] = last
    if at:
        rev_parts = [rev]
        if rev in ("refs",) and len(rest_parts) >= 2 and rest_parts[0] in ("pr", "convert"):
            rev_parts += rest_parts[:2]  # refs/pr/N, refs/convert/NAME
            rest_parts = rest_parts[2:]
        revision = urllib.parse.unquote("/".join(rev_parts))
        if not revision:
            raise _invalid(url, "an empty revision after '@'")
    for p in repo_parts:
        if not _REPO_PART.fullmatch(p) or ".." in p:
            raise _invalid(url, f"{p!r} is not a repo name")
    path = urllib.parse.unquote("/".join(rest_parts)).strip("/")
    if path and not safe_path(path):
        raise _invalid(url, f"the path {path!r} climbs out of the repo")
    return HubPath(repo_type, "/".join(repo_parts), revision, path)


def from_hub_url(url: str) -> str | None:
    """The ``hf://`` URL of a page or file URL of the Hub's own site (``https://huggingface.co/org/name``,
    ``.../tree/{rev}[/path]``, ``.../blob/{rev}/path``, ``.../resolve/{rev}/path``, ``datasets/``
    and ``spaces/`` likewise), or ``None`` for any other URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "https" or (parts.hostname or "").lower() not in ("huggingface.co", "hf.co") or \
            parts.query or parts.username is not None:
        return None
    segments = [urllib.parse.unquote(p) for p in parts.path.strip("/").split("/") if p]
    prefix = ""
    if segments and segments[0] in ("datasets", "spaces"):
        prefix, segments = f"{segments[0]}/", segments[1:]
    if len(segments) < 2 or (len(segments) > 2 and (segments[2] not in ("tree", "blob", "resolve") or len(segments) < 4)):
        return None
    repo, rest = "/".join(segments[:2]), segments[3:]
    rev = ""
    if len(segments) > 2:
        rev, rest = segments[3], segments[4:]
        if rev == "refs" and len(rest) >= 2 and rest[0] in ("pr", "convert"):
            rev, rest = "/".join([rev, *rest[:2]]), rest[2:]
    at = f"@{urllib.parse.quote(rev, safe='')}" if rev else ""
    path = "/".join(urllib.parse.quote(p) for p in rest)
    return f"hf://{prefix}{repo}{at}" + (f"/{path}" if path else "")


def safe_path(path: str) -> bool:
    """Whether ``path`` names a file inside a repo (relative, no ``..``, no empty part)."""
    return bool(path) and not path.startswith("/") and "\\" not in path and "\0" not in path and \
        all(p not in ("", ".", "..") for p in path.split("/"))


def hub_home() -> str:
    """``HF_HOME``, else ``$XDG_CACHE_HOME/huggingface``, else ``~/.cache/huggingface``."""
    home = os.environ.get("HF_HOME")
    if home:
        return os.path.expanduser(home)
    return os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME") or "~/.cache"), "huggingface")


def hub_cache() -> str:
    """The Hub cache's folder: ``HF_HUB_CACHE`` (``HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return os.path.expanduser(cache) if cache else os.path.join(hub_home(), "hub")


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "on", "yes", "true")


def hub_token() -> str | None:
    """The token of the environment, as huggingface_hub finds it (see the module doc)."""
    if _truthy("HF_HUB_DISABLE_IMPLICIT_TOKEN"):
        return None
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token and token.strip():
        return token.strip()
    path = os.environ.get("HF_TOKEN_PATH") or os.path.join(hub_home(), "token")
    try:
        with open(os.path.expanduser(path), "rb") as f:
            text = f.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return None
    return text or None


class Hub:
    """One ``hf://`` URL's repo: where its API and files are, the headers that carry the
    token, the commit a revision resolves to and the repo's file list at it.

    Parameters
    ----------
    url : str
    headers : mapping, optional
        The caller's headers; an ``Authorization`` among them is the token.
    endpoint : str, optional
        The Hub's address; default ``HF_ENDPOINT``, else ``https://huggingface.co``.
    """

    def __init__(self, url: str, headers: Mapping[str, str] | None = None, endpoint: str | None = None) -> None:
        self.url = url
        self.repo_type, self.repo_id, self.revision, self.path = split_hf_url(url)
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")
        self.headers = dict(headers or {})
        if not any(k.lower() == "authorization" for k in self.headers):
            token = hub_token()
            if token:
                self.headers["Authorization"] = f"Bearer {token}"
        self.sha: str | None = None
        self.files: list[str] = []
        #: file -> its blob id (an LFS file's sha256, else its git blob id), where the API gave one
        self.blobs: dict[str, str] = {}
        prefix = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        self._files_url = f"{self.endpoint}/{prefix}{self.repo_id}/resolve/"

    def __repr__(self) -> str:  # never the token
        how = "with a token" if self.has_token else "anonymous"
        return f"Hub({self.repo_type} {self.repo_id!r}@{self.revision or 'main'}, {self.endpoint!r}, {how})"

    @property
    def has_token(self) -> bool:
        return any(k.lower() == "authorization" for k in self.headers)

    @property
    def name(self) -> str:
        """The repo as messages name it: ``org/name`` (``datasets/org/name`` ...), with the revision."""
        prefix = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        rev = f"@{self.revision}" if self.revision else ""
        return f"{prefix}{self.repo_id}{rev}"

    def api_url(self) -> str:
        """The API call that resolves the revision: its commit and the repo's files."""
        rev = urllib.parse.quote(self.revision or "main", safe="")
        # blobs=true: each file's blob id (an LFS file's sha256), the names of the Hub cache's blobs
        return f"{self.endpoint}/api/{self.repo_type}s/{self.repo_id}/revision/{rev}?blobs=true"

    def resolve(self, body: bytes) -> None:
        """Take the API's answer: the commit (:attr:`sha`) and the file list (:attr:`files`)."""
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise ReadError(f"the Hub's answer about {self.name} is not JSON ({exc})", reason="HTTPError",
                            path=self.url) from None
        sha = doc.get("sha") if isinstance(doc, dict) else None
        if not isinstance(sha, str) or not _SHA.fullmatch(sha):
            raise ReadError(f"the Hub's answer about {self.name} gives no commit (its 'sha' is {sha!r:.60})",
                            reason="HTTPError", path=self.url)
        siblings = doc.get("siblings") or []
        if not isinstance(siblings, list) or len(siblings) > _MAX_FILES:
            raise ReadError(f"the Hub's answer about {self.name} has no list of files", reason="HTTPError",
                            path=self.url)
        self.sha = sha
        self.files = [s["rfilename"] for s in siblings
                      if isinstance(s, dict) and isinstance(s.get("rfilename"), str) and safe_path(s["rfilename"])]
        for s in siblings:
            if not isinstance(s, dict) or s.get("rfilename") not in self.files:
                continue
            lfs = s.get("lfs")
            blob = lfs.get("sha256") if isinstance(lfs, dict) else s.get("blobId")
            if isinstance(blob, str) and _BLOB.fullmatch(blob):
                self.blobs[s["rfilename"]] = blob

    @property
    def offline(self) -> bool:
        """``HF_HUB_OFFLINE``: the local Hub cache alone, no request at all."""
        return _truthy("HF_HUB_OFFLINE")

    def repo_cache(self) -> str:
        """The repo's folder of the local Hub cache (``models--org--name``)."""
        return os.path.join(hub_cache(), f"{self.repo_type}s--{self.repo_id.replace('/', '--')}")

    _folder = repo_cache

    @property
    def ref(self) -> str | None:
        """The ref the Hub cache records for this load: the branch or tag named (``main`` by
        default), none for a commit."""
        rev = self.revision or "main"
        return None if _SHA.fullmatch(rev) or not safe_path(rev) else rev

    def resolve_offline(self) -> None:
        """The commit and the file list from the local Hub cache (``refs/{revision}``, else a
        revision that is a commit; the files of its snapshot), as huggingface_hub does offline."""
        rev = self.revision or "main"
        sha: str | None = rev if _SHA.fullmatch(rev) else None
        if sha is None:
            try:
                with open(os.path.join(self._folder(), "refs", *rev.split("/")), "rb") as f:
                    sha = f.read(64).decode("ascii", "replace").strip()
            except OSError:
                sha = None
        snapshot = os.path.join(self._folder(), "snapshots", sha or "")
        if not sha or not _SHA.fullmatch(sha) or not os.path.isdir(snapshot):
            raise RemoteFileNotFoundError(
                f"HF_HUB_OFFLINE is set and the local Hub cache ({hub_cache()}) holds no snapshot of {self.name}",
                path=self.url)
        self.sha = sha
        files = []
        for dirpath, _, names in os.walk(snapshot):
            rel = os.path.relpath(dirpath, snapshot)
            files += [n if rel == "." else f"{rel.replace(os.sep, '/')}/{n}" for n in names]
        self.files = sorted(f for f in files if safe_path(f))

    def file_url(self, file: str) -> str:
        """Where ``file`` of the resolved commit is read (the Hub redirects it to its CDN)."""
        assert self.sha is not None
        return f"{self._files_url}{self.sha}/{urllib.parse.quote(file, safe='/')}"

    def file_of(self, location: str) -> str | None:
        """The file a :meth:`file_url` names (``None`` for another URL)."""
        if self.sha is None or not location.startswith(f"{self._files_url}{self.sha}/"):
            return None
        return urllib.parse.unquote(location[len(self._files_url) + len(self.sha) + 1:])

    def file_of_display(self, url: str) -> str | None:
        """The file a :meth:`display` URL names (``None`` for another URL)."""
        prefix = f"hf://{self.name}/"
        return url[len(prefix):] if url.startswith(prefix) and safe_path(url[len(prefix):]) else None

    def display(self, file: str) -> str:
        """``hf://`` URL of ``file``, as the user wrote the repo."""
        return f"hf://{self.name}/{file}"

    def cached(self, file: str) -> str | None:
        """The local Hub cache's copy of ``file`` at the resolved commit, if there is one."""
        if self.sha is None or not safe_path(file):
            return None
        path = os.path.join(self._folder(), "snapshots", self.sha, *file.split("/"))
        return path if os.path.isfile(path) else None

    def folder(self) -> tuple[str, list[str]]:
        """What the URL's path names in the file list, as a folder: ``("index", [file])``
        where it holds ``model.safetensors.index.json``, else ``("file" or "files", [...])``:
        every ``*.safetensors`` right in it."""
        prefix = f"{self.path}/" if self.path else ""
        index = f"{prefix}model.safetensors.index.json"
        if index in self.files:
            return "index", [index]
        found = sorted(f for f in self.files
                       if f.startswith(prefix) and "/" not in f[len(prefix):] and f.endswith(".safetensors"))
        if not found:
            where = f"in {self.path}/" if self.path else "at its top"
            raise RemoteFileNotFoundError(
                f"the Hugging Face repo {self.name} (commit {self.sha}) holds no .safetensors file and no "
                f"model.safetensors.index.json {where}", path=self.url)
        return ("file" if len(found) == 1 else "files"), found

    def explain(self, err: Any) -> Any:
        """The error to raise for ``err``, a request's: access refused (401, 403) becomes an
        error naming the repo and saying how to give a token; a 404 of the API names the repo
        and the revision; anything else is ``err`` itself."""
        status = getattr(err, "status", None)
        if getattr(err, "reason", None) == "AccessDenied" or status in (401, 403):
            code = f"HTTP {status}" if status else "access denied"
            detail = str(getattr(err, "message", err))
            m = re.search(r"HTTP \d{3} ([^)]*)\)", detail)
            if m:
                code = f"HTTP {status} {m.group(1)}"
            if self.has_token:
                how = ("the token sent was refused or has no access to it: check HF_TOKEN (or headers=), request "
                       "access on the repo's page if it is gated, or run `huggingface-cli login` again")
            else:
                how = "no token was found: set HF_TOKEN, or run `huggingface-cli login`"
            new = ReadError(f"access to the Hugging Face repo {self.name} was refused ({code}): a gated or private "
                            f"repo (or one that does not exist) needs a token with access to it; {how}",
                            reason="AccessDenied", path=getattr(err, "path", None) or self.url)
            new.status = status  # type: ignore[attr-defined]
            return new
        return err

    def not_found(self, err: Any) -> Any:
        """A 404 of the API call: no such repo or revision, named."""
        if getattr(err, "status", None) in (404, 410):
            return RemoteFileNotFoundError(
                f"the Hugging Face Hub at {self.endpoint} has no repo {self.repo_id!r} "
                f"with a revision {self.revision or 'main'!r} ({err.message})", path=self.url)
        return self.explain(err)

