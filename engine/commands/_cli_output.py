"""What the command line prints besides its results: progress bars (tqdm, on a terminal
only), a line per file done, byte counts, aligned tables and one-line errors."""

from __future__ import annotations

import errno
import sys
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["progress", "FileProgress", "fmt_bytes", "table", "one_line", "error_line", "UsageError",
           "http_headers"]


class UsageError(Exception):
    """A bad argument found after parsing (exit 2, one line)."""


def http_headers(values: Sequence[str] | None) -> dict[str, str]:
    """``-H 'Name: value'`` arguments as a mapping."""
    out = {}
    for value in values or ():
        name, sep, text = value.partition(":")
        if not sep or not name.strip():
            raise UsageError(f"--header expects 'Name: value', got {value!r}")
        out[name.strip()] = text.strip()
    return out


class NoBar:
    """Stands in for a tqdm bar when stderr is not a terminal or tqdm is not installed."""

    def __init__(self, iterable: Iterable | None = None) -> None:
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable or ())

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NoBar:
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress(iterable: Iterable | None = None, **kw: Any):
    """A tqdm bar on stderr when it is a terminal; silent (and tqdm not imported) otherwise."""
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return NoBar(iterable)
    try:
        from tqdm import tqdm
    except ImportError:
        return NoBar(iterable)
    return tqdm(iterable, file=sys.stderr, leave=False, dynamic_ncols=True, **kw)


class FileProgress:
    """Progress of a command that walks the tensors of a checkpoint, fed by the library's
    ``progress(name, nbytes)`` callback: a bar of bytes on a terminal (as :func:`progress`)
    and, with ``--verbose``, a line on stderr as each file is done."""

    def __init__(self, command: str, info: Any, verbose: bool, names: Iterable[str] | None = None) -> None:
        """``info``: the checkpoint's :class:`~engine.checkpoints.checkpoint.CheckpointInfo` (a local
        path's or a URL's, read once by the command)."""
        wanted = set(names) if names is not None else None
        self._command = command
        self._verbose = verbose
        self._shard_of: dict[str, str] = {}
        self._left: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        for shard, t in info.tensors():
            if wanted is None or t.name in wanted:
                self._shard_of[t.name] = shard
                self._left[shard] = self._left.get(shard, 0) + 1
                self._bytes[shard] = self._bytes.get(shard, 0) + t.nbytes
        self._count = dict(self._left)
        self._done = 0
        self._bar = progress(total=sum(self._bytes.values()), unit="B", unit_scale=True, desc=command)

    def __call__(self, name: str, nbytes: int) -> None:
        self._bar.update(nbytes)
        shard = self._shard_of.get(name)
        if shard is None:
            return
        self._left[shard] -= 1
        if self._left[shard] == 0 and self._verbose:
            self._done += 1
            line = (f"engine {self._command}: {self._done}/{len(self._left)} {shard}: "
                    f"{self._count[shard]} tensors, "
                    f"{fmt_bytes(self._bytes[shard])}")
            write = getattr(self._bar, "write", None)  # tqdm's, which keeps the bar below the line
            if write is not None:
                write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)

    def __enter__(self) -> FileProgress:
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()


def fmt_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``"512 B"``, ``"1.50 GB"``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"  # pragma: no cover


def table(rows: list[list[str]], header: list[str], right: Sequence[int] = ()) -> list[str]:
    """``rows`` under ``header`` as aligned lines; the columns in ``right`` aligned right."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return [line(header)] + [line(r) for r in rows]


def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line, for stderr."""
    return " ".join(str(err).split("\n"))


#: The reason tag of an operating system's error, by its errno (the engine's own errors
#: carry theirs in ``.reason``).
_OS_REASONS = {
    errno.ENOENT: "NotFound",
    errno.EACCES: "PermissionDenied",
    errno.EPERM: "PermissionDenied",
    errno.EROFS: "ReadOnlyFileSystem",
    errno.EISDIR: "IsADirectory",
    errno.ENOTDIR: "NotADirectory",
    errno.EEXIST: "FileExists",
    errno.ENOSPC: "NoSpace",
    errno.ELOOP: "SymbolicLinkLoop",
    errno.ENAMETOOLONG: "NameTooLong",
}


def error_line(err: BaseException) -> str:
    """``err`` as the command line prints it: one line ending in its ``[Reason]`` tag (the
    engine's ``.reason``; for an operating system's error, its errno's name, without the
    ``[Errno N]`` prefix; else the error's type)."""
    reason = getattr(err, "reason", None)
    if reason:
        return one_line(err)  # SafetensorError.__str__ ends with the tag
    if isinstance(err, OSError) and err.errno is not None and err.strerror:
        reason = _OS_REASONS.get(err.errno) or errno.errorcode.get(err.errno, type(err).__name__)
        where = f"{err.filename}: " if err.filename is not None else ""
        return f"{where}{' '.join(err.strerror.split())} [{reason}]"
    reason = "Usage" if isinstance(err, UsageError) else type(err).__name__
    return f"{one_line(err) or type(err).__name__} [{reason}]"
