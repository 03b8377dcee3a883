"""Files and directories that appear under their name only once complete.

Private: shared by :mod:`engine.writing.writer` (one file) and :mod:`engine.checkpoints.shards` (a checkpoint
directory).  Nothing of a save that dies (SIGKILL, power loss before the rename) should be
left behind:

* On Linux the file is written as an unnamed inode (``O_TMPFILE`` in the destination's
  directory) and given its name only when complete, with ``linkat`` through
  ``/proc/self/fd``.  A process killed while writing leaves nothing at all.  A new name is
  linked straight into place; over an existing file the inode is linked under a temporary
  name and renamed over it, so only a kill between those two system calls leaves a
  (complete) temporary file.
* Elsewhere, or where the file system refuses ``O_TMPFILE``, the file is created under a
  hidden temporary name ``.<name>.<pid>.<random>.tmp`` and renamed into place.

Every temporary (file or directory) carries its writer's process id in its name and is
held under an exclusive ``flock`` for the writer's lifetime.  Before a save, temporaries of
earlier saves to the same destination are removed, but only those whose process is gone
and whose lock is free: never a live writer's, in this process or another.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Callable
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from engine.errors import WriteError

__all__ = [
    "AtomicFile", "temp_name", "make_temp_dir", "remove_stale", "sync_dir", "lock", "umask", "write_error",
]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_TMPFILE = getattr(os, "O_TMPFILE", 0)
_SUFFIX = ".tmp"


def write_error(action: str, path: str, exc: BaseException) -> WriteError:
    """``WriteError`` for a failed ``action`` on ``path``, with the cause's ``errno``."""
    err = WriteError(f"could not {action}: {exc}", path=path)
    if isinstance(exc, OSError):
        err.errno, err.strerror = exc.errno, exc.strerror
    return err


def umask() -> int:
    """The process umask, read without the set-and-restore race of ``os.umask()``."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _prefix(base: str) -> str:
    return f".{base[:200]}."


def temp_name(directory: str, base: str) -> str:
    """A fresh hidden temporary path for ``base`` in ``directory``, carrying this process's id."""
    return os.path.join(directory, f"{_prefix(base)}{os.getpid()}.{os.urandom(6).hex()}{_SUFFIX}")


def _owner(name: str, base: str) -> int | None:
    """The writer's process id if ``name`` is one of our temporaries of ``base``."""
    prefix = _prefix(base)
    if not (name.startswith(prefix) and name.endswith(_SUFFIX)):
        return None
    pid, _, token = name[len(prefix) : -len(_SUFFIX)].partition(".")
    if not pid.isdigit() or len(token) != 12 or not all(c in "0123456789abcdef" for c in token):
        return None
    return int(pid)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another writer in this process: its lock decides below
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def lock(fd: int, *, wait: bool = True) -> bool:
    """Take an exclusive ``flock`` on ``fd``; False if ``wait`` is off and it is held."""
    if fcntl is None:  # pragma: no cover - Windows
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as exc:
        # file systems without locks: the process-id check alone has to do
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            return True
        raise
    return True


def remove_stale(directory: str, base: str) -> list[str]:
    """Remove temporaries of ``base`` in ``directory`` left by writers that died.

    A temporary is removed only when the process named in it no longer exists and no one
    holds its lock.  Returns the paths removed.  Never raises for a temporary it cannot
    inspect or remove (another writer's business).
    """
    if os.name == "nt" or fcntl is None:  # pragma: no cover - no pid probe without a signal there
        return []
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        pid = _owner(entry.name, base)
        if pid is None or _process_alive(pid):
            continue
        path = entry.path
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            fd = os.open(path, os.O_RDONLY | _CLOEXEC | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue
        try:
            if not (stat.S_ISREG(os.fstat(fd).st_mode) or is_dir) or not lock(fd, wait=False):
                continue
            if is_dir:
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def make_temp_dir(directory: str, base: str) -> tuple[str, int]:
    """A fresh hidden temporary directory for ``base`` in ``directory``, locked.

    Returns its path and the descriptor holding the lock (close it when done).
    """
    while True:
        path = temp_name(directory, base)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
        break
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    lock(fd)
    return path, fd


def sync_dir(directory: str) -> None:
    """``fsync`` a directory so that renames in it survive a power loss."""
    if os.name == "nt":  # pragma: no cover - directories cannot be opened there
        return
    fd = os.open(directory, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems do not sync directories; the file itself is already synced.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000


def _link_proc(fd: int, path: str) -> None:
    # the standard way: linkat(AT_SYMLINK_FOLLOW) of the descriptor's /proc entry
    os.link(f"/proc/self/fd/{fd}", path)


_linkat: Any = None


def _link_empty_path(fd: int, path: str) -> None:
    # linkat(fd, "", ..., AT_EMPTY_PATH): where /proc belongs to another mount namespace
    # (EXDEV); needs CAP_DAC_READ_SEARCH.  os.link has no way to pass it.
    global _linkat
    import ctypes

    if _linkat is None:
        _linkat = ctypes.CDLL(None, use_errno=True).linkat
        _linkat.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
        _linkat.restype = ctypes.c_int
    if _linkat(fd, b"", _AT_FDCWD, os.fsencode(path), _AT_EMPTY_PATH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)


#: st_dev -> the way an unnamed file is given a name there, or None when none works
_LINKERS: dict[int, Callable[[int, str], None] | None] = {}


def _linker(directory: str) -> Callable[[int, str], None] | None:
    """How to name an ``O_TMPFILE`` file in ``directory``, probed once per file system.

    The probe links a scratch unnamed file under a temporary name and removes it: a file
    must never be written unnamed where it could not be named afterwards.
    """
    if not _O_TMPFILE or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return None
    if dev in _LINKERS:
        return _LINKERS[dev]
    found = None
    remove_stale(directory, "engine-probe")  # of a process killed while probing
    try:
        fd = os.open(directory, _O_TMPFILE | os.O_WRONLY | _CLOEXEC, 0o600)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            for way in (_link_proc, _link_empty_path):
                probe = temp_name(directory, "engine-probe")
                try:
                    way(fd, probe)
                except OSError:
                    continue
                try:
                    os.unlink(probe)
                except OSError:
                    pass
                found = way
                break
        finally:
            os.close(fd)
    _LINKERS[dev] = found
    return found


class AtomicFile:
    """A file being written that appears at ``dest`` only on :meth:`commit`.

    Parameters
    ----------
    dest : str
        The final path (symlinks already resolved by the caller).
    mode : int
        Permission bits of the finished file.

    Attributes
    ----------
    fd : int
        Open for writing (``pwrite``); the file starts empty.
    temp : str or None
        The temporary path while there is one (the named scheme); None for an unnamed file.
    """

    def __init__(self, dest: str, mode: int) -> None:
        self.dest = dest
        self.directory, self.base = os.path.split(dest)
        self.directory = self.directory or "."
        self.temp: str | None = None
        if not os.path.isdir(self.directory):
            # named here: the temporary file's name, which the open would report, is not the
            # caller's mistake
            raise FileNotFoundError(errno.ENOENT, "no such directory to write into", self.directory)
        remove_stale(self.directory, self.base)
        fd = -1
        self._link = _linker(self.directory)
        if self._link is not None:
            try:
                # O_RDWR: should naming fail after all, the bytes can still be copied out
                fd = os.open(self.directory, _O_TMPFILE | os.O_RDWR | _CLOEXEC, mode)
            except OSError as exc:
                # EOPNOTSUPP: the file system has no unnamed files; EISDIR/EINVAL: the kernel
                # does not know O_TMPFILE; anything else (ENOENT, EACCES, ENOSPC) is real
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL):
                    raise
                self._link = None
        if fd < 0:
            while True:
                temp = temp_name(self.directory, self.base)
                try:
                    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o600)
                except FileExistsError:  # pragma: no cover - 48 random bits
                    continue
                self.temp = temp
                break
        self.fd: int | None = fd
        try:
            lock(fd)
            if hasattr(os, "fchmod"):
                os.fchmod(fd, mode)
        except BaseException:
            self.discard()
            raise

    def commit(self) -> None:
        """Give the complete file its name (atomically replacing ``dest``) and close it.

        The caller syncs the data first if it wants durability, and the directory after.
        On failure the temporary is removed and the file closed; ``dest`` is untouched.
        """
        fd = self.fd
        assert fd is not None
        try:
            if self.temp is None:
                assert self._link is not None
                try:
                    self._link(fd, self.dest)  # a new name: in place in one step
                except FileExistsError:
                    temp = temp_name(self.directory, self.base)
                    try:
                        self._link(fd, temp)
                    except FileExistsError:
                        raise
                    except OSError:
                        _copy_out(fd, temp)
                    self.temp = temp
                    os.replace(temp, self.dest)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                        raise
                    # the probe said naming works, yet it failed here: copy the bytes out
                    temp = temp_name(self.directory, self.base)
                    _copy_out(fd, temp)
                    self.temp = temp
                    os.replace(temp, self.dest)
            else:
                os.replace(self.temp, self.dest)
            self.temp = None
        except BaseException:
            self.discard()
            raise
        self.fd = None
        os.close(fd)

    def discard(self) -> None:
        """Close and remove the temporary; ``dest`` is untouched.  Idempotent."""
        fd, self.fd = self.fd, None
        temp, self.temp = self.temp, None
        discard(fd, temp)


def _copy_out(fd: int, temp: str) -> None:
    """Copy the unnamed file ``fd`` into a new file ``temp`` (the last resort of commit)."""
    size = os.fstat(fd).st_size
    out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o600)
    try:
        os.fchmod(out, stat.S_IMODE(os.fstat(fd).st_mode))
        done = 0
        while done < size:
            n = os.copy_file_range(fd, out, size - done, done, done)
            if n <= 0:
                raise OSError(errno.EIO, "copying the finished file into place stopped short")
            done += n
        os.fsync(out)
    except BaseException:
        os.close(out)
        os.unlink(temp)
        raise
    os.close(out)


def discard(fd: int | None, temp: str | None) -> None:
    """Close ``fd`` and unlink ``temp``, ignoring errors (for finalizers)."""
    if temp is not None:
        try:
            os.unlink(temp)  # before closing: the lock keeps a cleaner from racing us
        except OSError:
            pass
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass

