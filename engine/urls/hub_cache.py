"""``cache_dir="hf"``: the files of an ``hf://`` load kept in the local Hugging Face Hub cache.

A load of an ``hf://`` URL with ``cache_dir="hf"`` writes each file it receives whole into the
Hub cache, laid out as huggingface_hub lays it out, so that transformers, vLLM and the Hub's
own tools find it later without a second download (and so does the next load: a file of the
commit already there is read from disk, :meth:`engine.urls._remote_files.RemoteSource.local_path`)::

    $HF_HUB_CACHE/models--org--name/blobs/{sha256 of an LFS file, else its git blob id}
    $HF_HUB_CACHE/models--org--name/snapshots/{commit}/{file} -> ../../blobs/{id}
    $HF_HUB_CACHE/models--org--name/refs/{revision}             the commit (a branch or tag only)

The bytes are written as they land, exactly as for any ``cache_dir``
(:class:`engine.urls.remote_cache.Copies`: one write from where each body was received,
unnamed until the load succeeded and the file is on the disk), into a folder of the repo's
cache; a complete file is then linked into ``blobs/`` under the id the Hub's API gives, its
snapshot's symbolic link and the ref are replaced atomically, and the staging names are
removed; the index, read whole, is written likewise.  A blob already there is kept.  Nothing
else under ``HF_HOME`` is touched, and a load that fails leaves nothing there.
"""

from __future__ import annotations

import os
import uuid
import warnings

from engine.errors import CacheWriteWarning
from engine.urls.remote_cache import Copies

__all__ = ["HubCopies", "HUB_CACHE_DIR"]

#: The ``cache_dir`` that names the local Hub cache.
HUB_CACHE_DIR = "hf"
_STAGING = ".engine-incoming"


def _replace_link(target: str, link: str) -> None:
    """``link`` -> ``target`` (relative), made under a temporary name and renamed into place."""
    os.makedirs(os.path.dirname(link), exist_ok=True)
    tmp = f"{link}.{uuid.uuid4().hex}.tmp"
    os.symlink(os.path.relpath(target, os.path.dirname(link)), tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        os.unlink(tmp)
        raise


def _write_file(path: str, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_ref(path: str, sha: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        _write_file(tmp, sha.encode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


class HubCopies(Copies):
    """:class:`~engine.urls.remote_cache.Copies` whose complete copies go into the local Hub
    cache (see the module doc).

    Parameters
    ----------
    hub : engine.net._hub.Hub
        The repo, its commit resolved and its blob ids known.
    """

    def __init__(self, hub) -> None:
        self.hub = hub
        self.repo_dir = hub.repo_cache()
        super().__init__(os.path.join(self.repo_dir, _STAGING))
        self._staged: list[str] = []
        self._documents: dict[str, bytes] = {}

    def keep_document(self, file: str | None, data: bytes) -> None:
        """Also keep ``file`` (an index: its bytes as received) when the load succeeds."""
        if file is not None:
            self._documents[file] = data

    def _publish(self, file: str, blob: str, write) -> None:
        """``blobs/{blob}`` (made by ``write(temporary path)`` where missing) and the snapshot's link."""
        blob_path = os.path.join(self.repo_dir, "blobs", blob)
        os.makedirs(os.path.dirname(blob_path), exist_ok=True)
        if not os.path.exists(blob_path):
            tmp = f"{blob_path}.{uuid.uuid4().hex}.incomplete"
            try:
                write(tmp)
                os.replace(tmp, blob_path)
            except BaseException:
                if os.path.lexists(tmp):
                    os.unlink(tmp)
                raise
        _replace_link(blob_path, os.path.join(self.repo_dir, "snapshots", self.hub.sha, *file.split("/")))

    def commit(self) -> list[str]:
        """Name the complete copies (as :meth:`Copies.commit`), then publish each in the Hub
        cache's layout; returns the staged paths."""
        by_dest = {c.dest: c.url for c in self._copies}
        named = super().commit()
        published = False
        for path in named:
            self._staged.append(path)
            file = self.hub.file_of_display(by_dest.get(path, ""))
            blob = self.hub.blobs.get(file) if file is not None else None
            if blob is None:
                warnings.warn(CacheWriteWarning(f"no copy of {by_dest.get(path)} in the Hub cache: the Hub's API "
                                                "gave no blob id for it"), stacklevel=2)
                continue
            try:
                self._publish(file, blob, lambda tmp, path=path: os.link(path, tmp))
                published = True
            except OSError as exc:
                warnings.warn(CacheWriteWarning(f"{self.repo_dir}: no copy of {file} in the Hub cache: "
                                                f"{exc.strerror or exc}"), stacklevel=2)
        for file, data in self._documents.items() if published else ():
            blob = self.hub.blobs.get(file)
            if blob is None:
                continue
            try:
                self._publish(file, blob, lambda tmp, data=data: _write_file(tmp, data))
            except OSError as exc:
                warnings.warn(CacheWriteWarning(f"{self.repo_dir}: no copy of {file} in the Hub cache: "
                                                f"{exc.strerror or exc}"), stacklevel=2)
        if published and self.hub.ref is not None:
            try:
                _write_ref(os.path.join(self.repo_dir, "refs", *self.hub.ref.split("/")), self.hub.sha)
            except OSError as exc:
                warnings.warn(CacheWriteWarning(f"{self.repo_dir}: cannot write the ref {self.hub.ref}: "
                                                f"{exc.strerror or exc}"), stacklevel=2)
        return named

    def close(self) -> None:
        """As :meth:`Copies.close`, then the staging names go (the blobs keep the bytes)."""
        super().close()
        for path in self._staged:
            for p in (path, path + ".json"):
                try:
                    os.unlink(p)
                except OSError:
                    pass
        self._staged = []
        for folder in (self.cache_dir, self.repo_dir):  # what a load that kept nothing made
            try:
                os.rmdir(folder)
            except OSError:
                pass
