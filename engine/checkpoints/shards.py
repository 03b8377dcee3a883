"""Writing checkpoints: the shard split, the index JSON and :func:`save_sharded`.

The layout of ``huggingface_hub``/``transformers``: a small model as one
``model.safetensors``, a large one as shards ``model-00001-of-00004.safetensors`` ... plus an
index ``model.safetensors.index.json``.  :mod:`engine.checkpoints.checkpoint` reads what this writes.

A save goes into a hidden temporary directory inside the destination (same file system),
locked and named with the writer's process id, then is renamed into place file by file.
A save killed before the renames leaves only that hidden directory, which the next save
to the same destination removes (only when its process is gone and its lock is free).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any, NamedTuple, Union

from engine.base._atomic import make_temp_dir, remove_stale, sync_dir, write_error
from engine.errors import SerializationError, WriteError
from engine.format.header import MAX_HEADER_SIZE
from engine.io.reader import map_threads
from engine.writing import writer

__all__ = [
    "FILENAME_PATTERN",
    "ShardSplit",
    "parse_size",
    "split_into_shards",
    "index_json",
    "INDEX_FORMATS",
    "save_sharded",
]

PathLike = Union[str, "os.PathLike[str]"]

#: ``huggingface_hub``'s ``SAFETENSORS_WEIGHTS_FILE_PATTERN``.
FILENAME_PATTERN = "model{suffix}.safetensors"
#: ``huggingface_hub``'s size units: decimal, "5GB" is 5 * 10**9 bytes.  The binary units
#: are ``transformers``' additions.
_SIZE_UNITS = {
    "TB": 10**12,
    "GB": 10**9,
    "MB": 10**6,
    "KB": 10**3,
    "TIB": 2**40,
    "GIB": 2**30,
    "MIB": 2**20,
    "KIB": 2**10,
}
# Above a few shards, more threads only queue on the same disk.
_MAX_THREADS = 8


class ShardSplit(NamedTuple):
    """Where each tensor goes; the fields of ``huggingface_hub``'s ``StateDictSplit``."""

    #: shard file name -> tensor names, in the mapping's order
    filename_to_tensors: dict[str, list[str]]
    #: tensor name -> shard file name
    tensor_to_filename: dict[str, str]
    #: ``{"total_size": bytes}``, the index's metadata
    metadata: dict[str, int]

    @property
    def is_sharded(self) -> bool:
        return len(self.filename_to_tensors) > 1


def parse_size(size: int | str) -> int:
    """Bytes for ``max_shard_size``: an int, or a string such as ``"5GB"`` or ``"500MiB"``.

    Parameters
    ----------
    size : int or str
        Decimal units as ``huggingface_hub`` reads them (``"KB"``, ``"MB"``, ``"GB"``,
        ``"TB"``, case-insensitive: ``"5GB"`` is ``5 * 10**9``), binary units ``"KiB"`` ...
        ``"TiB"`` as ``transformers`` reads them; a number may have a fraction (``"1.5GB"``).

    Returns
    -------
    int

    Raises
    ------
    SerializationError
        ``reason="InvalidShardSize"``: an unknown unit, not a number, or not positive.
    """
    if isinstance(size, bool):
        raise SerializationError(f"max_shard_size must be an int or a string, got {size!r}", reason="InvalidShardSize")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        text = size.strip()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]+)", text)
        unit = m.group(2).upper() if m else ""
        if not m or unit not in _SIZE_UNITS:
            raise SerializationError(
                f"cannot read the size {size!r}; use bytes as an int or a number with a unit "
                f"({', '.join(u if u.endswith('B') and len(u) == 2 else u[:-3] + 'iB' for u in _SIZE_UNITS)})",
                reason="InvalidShardSize",
            )
        value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise SerializationError(
            f"max_shard_size must be an int or a string, got {type(size).__name__}", reason="InvalidShardSize"
        )
    if value <= 0:
        raise SerializationError(f"max_shard_size must be positive, got {size!r}", reason="InvalidShardSize")
    return value


def _check_pattern(pattern: str) -> tuple[str, str]:
    if not isinstance(pattern, str) or pattern.count("{suffix}") != 1 or not pattern.endswith(".safetensors"):
        raise SerializationError(
            f"filename_pattern must contain '{{suffix}}' once and end with '.safetensors', got {pattern!r}",
            reason="InvalidFilenamePattern",
        )
    prefix, _, suffix = pattern.partition("{suffix}")
    if "/" in pattern or "\\" in pattern or not prefix or prefix.startswith("."):
        raise SerializationError(
            f"filename_pattern must be a plain, non-hidden file name, got {pattern!r}", reason="InvalidFilenamePattern"
        )
    return prefix, suffix


def split_into_shards(
    sizes: Mapping[str, int], max_shard_size: int | str = "5GB", *, filename_pattern: str = FILENAME_PATTERN
) -> ShardSplit:
    """Assign tensors to shards the way ``huggingface_hub.split_torch_state_dict_into_shards`` does.

    Parameters
    ----------
    sizes : mapping of str to int
        Tensor name to its size in bytes, in the order the tensors should be considered.
    max_shard_size : int or str, default "5GB"
        See :func:`parse_size`.
    filename_pattern : str, default "model{suffix}.safetensors"
        ``{suffix}`` becomes ``""`` for a single shard, else ``"-00001-of-00004"``.

    Returns
    -------
    ShardSplit

    Notes
    -----
    Greedy, in order: a tensor that would push the current shard over the limit starts a
    new shard; a tensor larger than the limit gets a shard of its own (which exceeds the
    limit), the current shard staying open for the tensors after it.  An empty mapping
    gives one empty shard.
    """
    limit = parse_size(max_shard_size)
    _check_pattern(filename_pattern)
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    total = 0
    for name, size in sizes.items():
        total += size
        if size > limit:
            shards.append([name])
            continue
        if current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        names = [filename_pattern.format(suffix="")]
    else:
        names = [filename_pattern.format(suffix=f"-{i + 1:05d}-of-{len(shards):05d}") for i in range(len(shards))]
    to_tensors = dict(zip(names, shards, strict=True))
    to_file = {t: f for f, ts in to_tensors.items() for t in ts}
    return ShardSplit(to_tensors, to_file, {"total_size": total})


#: The index layouts :func:`index_json` writes, by the tool whose files they equal.
INDEX_FORMATS = ("huggingface_hub", "transformers")


def index_json(split: ShardSplit, index_format: str = "huggingface_hub", *, total_parameters: int | None = None) -> str:
    """The index file's text, byte for byte as ``huggingface_hub`` or ``transformers`` writes it.

    Parameters
    ----------
    split : ShardSplit
    index_format : {"huggingface_hub", "transformers"}, default "huggingface_hub"
        ``"huggingface_hub"``: ``save_torch_state_dict``'s ``json.dump(index, f, indent=2)``:
        ``{"metadata": {"total_size": N}, "weight_map": {...}}`` in that order, the weight
        map in shard order, no final newline.  ``"transformers"``: ``save_pretrained``'s
        ``json.dumps(index, indent=2, sort_keys=True) + "\n"``, with ``total_parameters``
        added to the metadata.
    total_parameters : int, optional
        The ``"transformers"`` metadata entry; required for that format.

    Raises
    ------
    SerializationError
        An unknown ``index_format``, or ``"transformers"`` without ``total_parameters``.
    """
    if index_format == "huggingface_hub":
        return json.dumps({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, indent=2)
    if index_format == "transformers":
        if total_parameters is None:
            raise SerializationError("the transformers index needs total_parameters", reason="InvalidIndexFormat")
        doc = {"metadata": {"total_parameters": total_parameters, **split.metadata},
               "weight_map": split.tensor_to_filename}
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"
    raise SerializationError(
        f"index_format must be one of {INDEX_FORMATS}, got {index_format!r}", reason="InvalidIndexFormat"
    )


def _default_metadata(tensors: Mapping[str, Any]) -> dict[str, str] | None:
    """``{"format": "pt"}`` for torch tensors, as ``huggingface_hub`` and ``transformers``
    write it (transformers refuses other formats but tf, flax and mlx); none for numpy
    arrays, as the reference's ``safetensors.numpy.save_file`` writes."""
    for value in tensors.values():
        if type(value).__module__.partition(".")[0] == "torch":
            return {"format": "pt"}
    return None


def _fsync_write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(
    tensors: Mapping[str, Any],
    directory: PathLike,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    *,
    filename_pattern: str = FILENAME_PATTERN,
    fsync: bool = True,
    max_workers: int | None = None,
    max_header_size: int = MAX_HEADER_SIZE,
    index_format: str = "huggingface_hub",
) -> ShardSplit:
    """Write tensors as a (possibly sharded) checkpoint, as Hugging Face tools lay it out.

    Parameters
    ----------
    tensors : mapping of str to numpy.ndarray or torch.Tensor
        As for :func:`engine.writing.writer.save_file`: contiguous, dense, not sharing memory.
        The mapping's order decides the split (as in ``huggingface_hub``).
    directory : str or os.PathLike
        Created if missing (with its parents).
    max_shard_size : int or str, default "5GB"
        Largest shard, counting tensor bytes (``"5GB"`` is ``5 * 10**9``); see
        :func:`parse_size` and :func:`split_into_shards`.
    metadata : mapping of str to str, optional
        ``__metadata__`` of every shard.  Default: ``{"format": "pt"}`` for torch tensors,
        as ``huggingface_hub`` and ``transformers`` write it; none for numpy arrays.
    filename_pattern : str, default "model{suffix}.safetensors"
        Shard names: ``model.safetensors`` alone, or ``model-00001-of-00004.safetensors``
        ... with the index ``model.safetensors.index.json``.
    fsync : bool, default True
        Sync every file and the directory before and after renaming into place.
    max_workers : int, optional
        Shards written in parallel (default: up to 8).
    max_header_size : int, default 100,000,000
        Largest header of each shard, as for :func:`engine.writing.writer.save_file`.
    index_format : {"huggingface_hub", "transformers"}, default "huggingface_hub"
        The index text, byte for byte as that tool writes it (see :func:`index_json`);
        ``"transformers"`` adds ``total_parameters``, counted here as the elements of
        every tensor written (``save_pretrained`` counts ``model.num_parameters()``, which
        leaves out persistent buffers).

    Returns
    -------
    ShardSplit
        File names, tensor placement and ``{"total_size": ...}``.

    Raises
    ------
    SerializationError
        Before anything is written: what :func:`engine.writing.writer.save_file` rejects (checked
        over all tensors at once, so two tensors sharing memory are caught even when they
        would land in different shards), or a bad ``max_shard_size``/``filename_pattern``.
    WriteError
        Writing or renaming failed; ``.path`` names the file in ``directory`` (never the
        hidden temporary directory); see Notes for what is left.

    Notes
    -----
    By default the files equal ``huggingface_hub.save_torch_state_dict``'s byte for byte
    (its defaults: ``metadata`` ``{"format": "pt"}``, the index as :func:`index_json`
    writes it): the same split (greedy in the mapping's order), names, headers and index.
    ``total_size`` counts tensor bytes; ``huggingface_hub`` counts each tensor's whole
    storage, which is the same for tensors that own their memory (a view into a larger
    buffer counts only its bytes here).  With ``metadata`` given, the engine writes it
    into every shard, where ``huggingface_hub`` writes ``{"format": "pt"}`` into the
    shards of a sharded checkpoint and the caller's metadata into the index.

    What is guaranteed:

    * every shard and the index are first written completely into a hidden temporary
      directory inside ``directory`` (same file system) and synced; any failure up to
      then removes it and leaves ``directory`` exactly as it was (a ``directory`` created
      by this call is removed again);
    * then the files are renamed into place, shards first and the index last, each
      rename atomic: a reader sees every file whole, old or new, never partial;
    * if a rename fails, the files already replaced are restored from hard links taken
      just before (where the file system has hard links) and new ones removed, then
      ``WriteError`` is raised;
    * after the index is in place, files of a previous save that match the pattern but
      are not part of this one (``model.safetensors`` when now sharded, old shards of a
      different count, a stale index) are removed, as ``huggingface_hub`` does.

    Not guaranteed: several files cannot be replaced in one atomic step, so a reader
    that opens the checkpoint *during* the renames, or a crash (power loss) in the middle
    of them, can see a mix of old and new shards that share names.  A killed process
    leaves its hidden ``.model.checkpoint.<pid>.<random>.tmp`` directory behind; the next
    save to ``directory`` removes it (once that process is gone and its lock is free).

    Copies of tensor bytes: as for :func:`engine.writing.writer.save_file` (0 for CPU tensors).
    """
    prefix, suffix = _check_pattern(filename_pattern)
    # validates everything, all shards at once (the header limit applies per shard, below)
    if metadata is None:
        metadata = _default_metadata(tensors)
    sizes = writer.tensor_sizes(tensors, metadata)
    split = split_into_shards(sizes, max_shard_size, filename_pattern=filename_pattern)
    index_name = filename_pattern.format(suffix="") + ".index.json"
    meta = dict(metadata) if metadata is not None else None
    total_parameters = None
    if index_format == "transformers":
        total_parameters = sum(math.prod(tuple(t.shape)) for t in tensors.values())
    index_text = index_json(split, index_format, total_parameters=total_parameters)  # checks index_format

    dest = os.fspath(directory)
    temp_base = f"{prefix}.checkpoint"
    created = not os.path.isdir(dest)
    try:
        os.makedirs(dest, exist_ok=True)
        remove_stale(dest, temp_base)
        tmpdir, lock_fd = make_temp_dir(dest, temp_base)
    except OSError as exc:
        raise write_error("create the checkpoint directory", dest, exc) from exc

    def write_shard(entry: tuple[str, list[str]]) -> None:
        filename, names = entry
        try:
            writer.save_file(
                {n: tensors[n] for n in names}, os.path.join(tmpdir, filename), meta,
                fsync=fsync, max_header_size=max_header_size,
            )
        except (WriteError, SerializationError) as exc:
            # name the shard where it will live, not the hidden directory it was written in
            exc.path = os.path.join(dest, filename)
            raise

    new_files = list(split.filename_to_tensors)
    try:
        try:
            jobs = list(split.filename_to_tensors.items())
            # every shard finishes before the first failure (in order) is raised
            map_threads(write_shard, jobs, max_workers or _MAX_THREADS, name="engine-shard")
            if split.is_sharded:
                _fsync_write(os.path.join(tmpdir, index_name), index_text.encode("utf-8"))
                new_files.append(index_name)
        except OSError as exc:
            if isinstance(exc, WriteError):
                raise
            raise write_error("write the index", os.path.join(dest, index_name), exc) from exc
        _commit(tmpdir, dest, new_files, fsync)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        os.close(lock_fd)
        if created:
            try:
                os.rmdir(dest)  # only if still empty
            except OSError:
                pass
        raise

    # stale files of a previous save, with huggingface_hub's pattern
    stale = re.compile(re.escape(prefix) + r"(-\d{5}-of-\d{5})?" + re.escape(suffix) + r"(\.index\.json)?")
    keep = set(new_files)
    try:
        for name in os.listdir(dest):
            if name not in keep and stale.fullmatch(name) and os.path.isfile(os.path.join(dest, name)):
                try:
                    os.unlink(os.path.join(dest, name))
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise write_error(
                        "remove a file of the previous checkpoint (the new one is complete and in place)",
                        os.path.join(dest, name),
                        exc,
                    ) from exc
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
        os.close(lock_fd)
    if fsync:
        sync_dir(dest)
    return split


def _commit(tmpdir: str, dest: str, names: list[str], fsync: bool) -> None:
    """Rename ``names`` from ``tmpdir`` into ``dest``; all or (as far as possible) nothing."""
    backup = os.path.join(tmpdir, ".previous")
    os.mkdir(backup)
    done: list[tuple[str, bool]] = []  # (name, had a previous file backed up)
    try:
        for name in names:
            target = os.path.join(dest, name)
            backed = False
            try:
                os.link(target, os.path.join(backup, name), follow_symlinks=False)
                backed = True
            except OSError:
                # missing (a new file), or no hard links on this file system: nothing to
                # restore from for this one
                pass
            os.replace(os.path.join(tmpdir, name), target)
            done.append((name, backed))
    except BaseException as exc:
        for name, backed in reversed(done):
            target = os.path.join(dest, name)
            try:
                if backed:
                    os.replace(os.path.join(backup, name), target)
                else:
                    os.unlink(target)
            except OSError:
                pass
        if isinstance(exc, OSError):
            raise write_error(f"move {name!r} into place", os.path.join(dest, name), exc) from exc
        raise
    if fsync:
        sync_dir(dest)
