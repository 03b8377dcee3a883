"""Opening files for reading without the ways an open can hang or mislead.

Private: shared by :mod:`engine.format.header`, :mod:`engine.loading.file_handle` and :mod:`engine.checkpoints.checkpoint`
(and :data:`IOV_MAX` by the reader and the writer).
A FIFO named like a checkpoint would block ``open()`` until a writer appears, and reading a
character device never ends; so the file is opened with ``O_NONBLOCK`` (which regular
files ignore), checked with ``fstat`` and refused unless it is a regular file.  A symlink
loop becomes a :class:`~engine.errors.ReadError` (still an ``OSError`` with ``errno``
``ELOOP``) that names the path.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["open_regular", "file_size", "IOV_MAX", "NETWORK_FILE_SYSTEMS", "mount_type", "on_network_mount",
           "parse_mount_types", "advise_sequential"]

#: Most buffers one ``preadv`` or ``pwritev`` call takes (the reader's and the writer's batches).
IOV_MAX = 1024
try:
    IOV_MAX = int(os.sysconf("SC_IOV_MAX")) or IOV_MAX
except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
    pass

_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


#: Below this many bytes a mapped load is left to the kernel's own read-ahead (no prefetch
#: threads, and no need for the reader's module at all).
PREFETCH_MIN_BYTES = 16 << 20


def is_url(path) -> bool:
    """Whether ``path`` is a URL (``scheme://...``, a scheme of two letters or more) rather
    than a local path (a Windows drive letter is not a scheme)."""
    if not isinstance(path, str):
        return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and len(scheme) > 1 and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum()


def open_regular(path: str) -> int:
    """Open ``path`` read-only and return the descriptor; refuse anything but a regular file.

    Raises
    ------
    ReadError
        ``reason="NotRegularFile"`` for a FIFO, device or socket (``errno`` ``EINVAL``);
        ``reason="SymlinkLoop"`` for a loop of symbolic links (``errno`` ``ELOOP``).
    OSError
        As ``os.open`` raises it otherwise (``FileNotFoundError``, ``PermissionError``,
        ``IsADirectoryError`` when reading a directory).
    """
    try:
        fd = os.open(path, _FLAGS | _NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            from engine.errors import ReadError

            err = ReadError(
                "too many levels of symbolic links (a symlink loop?)", reason="SymlinkLoop", path=path
            )
            err.errno, err.strerror = exc.errno, exc.strerror
            raise err from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            from engine.errors import ReadError

            what = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            err = ReadError(
                f"the path is {what}, not a regular file; refusing to read it", reason="NotRegularFile", path=path
            )
            err.errno, err.strerror = errno.EINVAL, os.strerror(errno.EINVAL)
            raise err
        if _NONBLOCK:
            # back to blocking reads: O_NONBLOCK has no effect on a regular file on Linux, but
            # some file systems (FUSE, network) might honour it
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: File systems whose reads cross a network or a user-space daemon, as ``/proc/self/mountinfo``
#: names them (a FUSE mount is ``fuse``, ``fuseblk`` or ``fuse.<daemon>``: gcsfuse, s3fs,
#: blobfuse, sshfs, JuiceFS ...).  There a page fault of a mapping is a round trip for the
#: read-ahead window around it, so a load that faults a mapping in page by page stalls; the
#: native split copies read such files with large ``pread``s instead
#: (:func:`engine.io.reader.copy_mapping`), and a handle's mapping gets :func:`advise_sequential`
#: and no prefetch (:mod:`engine.loading.file_handle`).
NETWORK_FILE_SYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "v9fs", "ceph", "lustre", "gpfs", "beegfs", "glusterfs",
    "afs", "orangefs", "pvfs2", "virtiofs", "davfs", "fuse", "fuseblk",
})

_MOUNT_TYPES: dict[tuple[int, int], str] = {}  # (major, minor) -> type, filled on first need


def parse_mount_types(text: str) -> dict[tuple[int, int], str]:
    """``{(major, minor): type}`` from the text of ``/proc/self/mountinfo``.

    Each line is ``id parent major:minor root mount-point options [optional fields] - type
    source super-options``; lines that do not parse are skipped.
    """
    types: dict[tuple[int, int], str] = {}
    for line in text.splitlines():
        fields = line.split()
        try:
            major, minor = fields[2].split(":")
            kind = fields[fields.index("-", 6) + 1]
            types[(int(major), int(minor))] = kind
        except (IndexError, ValueError):
            continue
    return types


def mount_type(fd: int) -> str:
    """The type of the file system holding ``fd`` (``"ext4"``, ``"nfs4"``, ``"fuse.s3fs"`` ...),
    or ``""`` where it cannot be told.

    Read from ``/proc/self/mountinfo`` by the file's device number, and only for device
    numbers of major 0: a local disk's file system (ext4, xfs on a block device) has a real
    major and is ``""`` here without any read, so a load from one pays nothing for the
    question.  Kept per device for the process: a device number freed by an unmount and
    taken by another type of mount keeps the first type.
    """
    try:
        dev = os.fstat(fd).st_dev
    except OSError:
        return ""
    key = (os.major(dev), os.minor(dev))
    if key[0] != 0:
        return ""
    kind = _MOUNT_TYPES.get(key)
    if kind is None:
        # read again on every miss (a device mounted since, or one mountinfo does not list, as
        # a btrfs subvolume's): a load asks once per file
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                _MOUNT_TYPES.update(parse_mount_types(f.read()))
        except OSError:
            pass
        kind = _MOUNT_TYPES.get(key, "")
    return kind


def on_network_mount(fd: int) -> bool:
    """Whether ``fd``'s file lies on a network or FUSE file system (:data:`NETWORK_FILE_SYSTEMS`)."""
    kind = mount_type(fd)
    return kind in NETWORK_FILE_SYSTEMS or kind.startswith("fuse.")


def advise_sequential(fd: int) -> None:
    """Tell the kernel the file will be read front to back (``POSIX_FADV_SEQUENTIAL``): its
    read-ahead window for this descriptor doubles, so a cold page cache is filled in half as
    many reads, and a warm one costs nothing.  Advice only; an error is ignored."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass


def file_size(fd: int) -> int | None:
    """The file's size now, for messages; ``None`` when ``fstat`` fails."""
    try:
        return os.fstat(fd).st_size
    except OSError:
        return None
