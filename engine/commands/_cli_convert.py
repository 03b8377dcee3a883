"""``engine convert``: a PyTorch checkpoint (``torch.save``'s zip, pickle or tar formats) to a
safetensors file.  The format is sniffed from the first bytes before any reader sees the
file, so that a wrong or truncated file is one clear error, not an unpickler's traceback.
"""

from __future__ import annotations

import errno
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from engine.base._files import is_url
from engine.commands._cli_output import fmt_bytes, one_line, progress
from engine.errors import MissingDependencyError, SafetensorError, WriteError

__all__ = ["cmd_convert", "check_output"]


def _torch():
    try:
        import torch
    except ImportError:
        raise MissingDependencyError("torch", "torch", "engine convert") from None
    return torch


#: How the first bytes of a file tell its format: torch.save's zip archive (torch >= 1.6),
#: its legacy pickle stream (a pickle PROTO opcode) or tar archive, and a safetensors header
#: (an 8-byte length, then the JSON object).
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_LFS_POINTER = b"version https://git-lfs"


def _sniff(path: str) -> str:
    """``"zip"``, ``"pickle"`` (also tar) or ``"safetensors"``: which reader ``path`` needs.

    Decided from the first bytes, before any reader sees the file: ``torch.load`` handed a
    text file fails deep inside its unpickler with whatever exception the stray bytes
    provoke (``KeyError: 101`` for an ``e``), and hands any ``.safetensors`` path to the
    safetensors package, whose errors name no file.
    """
    from engine.base._files import open_regular

    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "Is a directory, not a checkpoint file", path)
    fd = open_regular(path)  # a FIFO would block a plain open
    try:
        head = os.pread(fd, 512, 0)
    finally:
        os.close(fd)
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5) or head[257:262] == b"ustar":
        return "pickle"  # or the tar archive of torch < 0.4, which torch.load reads the same way
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if head.startswith(_LFS_POINTER):
        what = "a Git LFS pointer, not the checkpoint (fetch the file itself, e.g. with `git lfs pull`)"
    elif not head:
        what = "an empty file"
    else:
        printable = all(32 <= b < 127 or b in b"\t\r\n" for b in head)
        what = f"{'a text file' if printable else 'not a checkpoint'} (it starts with {head[:16]!r})"
    raise SafetensorError(
        f"{what}: expected a file written by torch.save or a .safetensors file", reason="InvalidCheckpoint", path=path
    )


def _load_torch_checkpoint(path: str, kind: str, torch) -> Any:
    """What the file at ``path`` holds, by the reader its format needs.

    torch.save's files go through ``torch.load(weights_only=True)`` (no code is ever
    unpickled), memory-mapped when they are zip archives; a ``.safetensors`` file goes
    through the engine's own reader.
    """
    import pickle

    if kind == "safetensors":
        from engine.torch import load_file

        return load_file(path)
    try:
        with warnings.catch_warnings():
            # torch's notes on the pickle's protocol say nothing about the file's tensors
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")
            if kind == "zip":
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message opens with advice to load without weights_only, which this refusal
        # exists to avoid; the cause follows its "WeightsUnpickler error:"
        text = str(exc)
        _, marker, rest = text.partition("WeightsUnpickler error:")
        cause = " ".join(rest.split("Check the documentation")[0].split()) if marker else ""
        cause = cause or " ".join(text.strip().splitlines()[:1]) or type(exc).__name__
        raise SafetensorError(
            f"refusing to load: the pickle needs more than plain tensors and containers "
            f"(torch.load(weights_only=True) refused it: {cause})",
            reason="UnsafePickle",
            path=path,
        ) from None
    except (MemoryError, RecursionError):
        raise
    except Exception as exc:  # a damaged archive or stream: torch raises whatever its reader met
        said = one_line(exc)[:300] or type(exc).__name__
        raise SafetensorError(
            f"not a PyTorch checkpoint torch.load can read (truncated or damaged?): {type(exc).__name__}: {said}",
            reason="InvalidCheckpoint",
            path=path,
        ) from None


def check_output(dst: str, src: str) -> None:
    """Fail before any work when ``dst`` cannot be written: name the missing directory (the
    writer, which writes a temporary file beside ``dst``, would name that file), and refuse
    to replace the input itself (the atomic writer would, losing the source weights)."""
    if is_url(dst):
        raise WriteError("the output is a URL; the commands write local files (upload the result after)",
                         reason="LocalPathExpected", path=dst)
    folder = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(folder):
        raise FileNotFoundError(errno.ENOENT, "the output directory does not exist", folder)
    if os.path.isdir(dst):
        raise IsADirectoryError(errno.EISDIR, "the output is a directory; give a file name", dst)
    try:
        same = os.path.samefile(src, dst)
    except OSError:  # no output yet, or no input (its own error comes next)
        same = False
    if same:
        raise FileExistsError(errno.EEXIST, "the output is the input file; write the result elsewhere", dst)


def _state_dict(obj: Any, torch, path: str) -> tuple[dict, list[str]]:
    """The flat ``name -> tensor`` mapping inside what ``torch.load`` returned."""
    if isinstance(obj, Mapping) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in ("state_dict", "model", "module"):
            inner = obj.get(key)
            if isinstance(inner, Mapping) and any(isinstance(v, torch.Tensor) for v in inner.values()):
                print(f"note: converting the tensors under {key!r}", file=sys.stderr)
                obj = inner
                break
    if not isinstance(obj, Mapping):
        raise SafetensorError(
            f"expected a state dict (a mapping of names to tensors), got {type(obj).__name__}",
            reason="InvalidCheckpoint",
            path=path,
        )
    tensors, skipped = {}, []
    for name, value in obj.items():
        if isinstance(name, str) and isinstance(value, torch.Tensor):
            tensors[name] = value
        else:
            skipped.append(str(name))
    if not tensors:
        raise SafetensorError("the checkpoint holds no tensors", reason="InvalidCheckpoint", path=path)
    return tensors, skipped


def cmd_convert(args) -> int:
    """``engine convert SRC DST``: a ``torch.save`` checkpoint to one safetensors file."""
    check_output(args.dst, args.src)
    if is_url(args.src):  # torch.load reads a local file; a pickle is not read by ranges
        raise SafetensorError("engine convert reads a local file written by torch.save, not a URL: download it "
                              "first (e.g. curl -LO URL)", reason="LocalPathExpected", path=args.src)
    kind = _sniff(args.src)  # a missing or wrong input fails here, before torch's import (seconds)
    torch = _torch()
    from engine.base.dtypes import BY_NAME, from_torch
    from engine.writing import writer

    obj = _load_torch_checkpoint(args.src, kind, torch)
    tensors, skipped = _state_dict(obj, torch, args.src)
    if skipped:
        print(f"note: skipped {len(skipped)} non-tensor entries: {', '.join(skipped[:8])}", file=sys.stderr)
    from engine.torch import deduplicate

    tensors, aliases, copied = deduplicate(tensors)
    metadata = {"format": "pt"}
    for dropped, kept in aliases.items():
        metadata.setdefault(dropped, kept)
    entries = []
    for name, t in tensors.items():
        code = from_torch(t.dtype)
        shape = tuple(t.shape)
        if code == BY_NAME["F4"].code and shape:  # float4_e2m1fn_x2 counts bytes, the format values
            shape = shape[:-1] + (shape[-1] * 2,)
        entries.append((name, code, shape))
    total = sum(t.nbytes for t in tensors.values())
    with writer.open_writer(args.dst, entries, metadata) as w, progress(
        total=total, unit="B", unit_scale=True, desc="convert"
    ) as bar:
        for name, t in tensors.items():
            w.write(name, t)
            bar.update(t.nbytes)
    print(f"wrote {args.dst}: {len(tensors)} tensors, {fmt_bytes(total)}")
    if aliases:
        print("shared tensors stored once (dropped -> kept, also in the metadata): "
              + ", ".join(f"{d} -> {k}" for d, k in aliases.items()))
    if copied:
        print(f"copied to contiguous memory: {', '.join(copied)}")
    return 0
