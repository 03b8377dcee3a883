"""torch flavour of the reference API: loading, saving, and the shared-storage helpers.

``load_file``, ``load``, ``save_file``, ``save``, ``save_model``, ``load_model`` and the
helpers libraries call to reason about shared storages (``storage_ptr``, ``storage_size``,
``_find_shared_tensors``, ``_remove_duplicate_names``, ``_end_ptr``), with the reference's
signatures, results and exception types.  Every tensor handed out has a storage of its own
that covers exactly its bytes, as with the reference, so these helpers (and accelerate,
transformers and ``torch.save``, which use the same reasoning) see each tensor alone.

Importing this module imports torch: that is the opt-in.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from engine.errors import MissingDependencyError as _Missing

try:
    import torch
except ModuleNotFoundError as _exc:  # the ``torch`` extra
    raise _Missing.of(_exc, "engine.torch (torch tensors; engine.numpy gives numpy arrays without torch)") from None

from engine.apps.opener import is_checkpoint_path, safe_open
from engine.base import dtypes
from engine.base._files import is_url
from engine.errors import SerializationError
from engine.format.header import parse_buffer
from engine.format.verification import verification
from engine.loading.handle_reads import views
from engine.sinks.torch import TorchSink
from engine.writing import writer

# the reference's safetensors.torch has them too
from engine.writing.tensorspec import TensorSpec as TensorSpec
from engine.writing.tensorspec import deserialize as deserialize
from engine.writing.tensorspec import serialize as serialize
from engine.writing.tensorspec import serialize_file as serialize_file

__all__ = [
    "load_file",
    "load",
    "save_file",
    "save",
    "save_model",
    "load_model",
    "storage_ptr",
    "storage_size",
    "deduplicate",
]


def load_file(
    filename, device: str | int | torch.device = "cpu", *, backend: str = "mmap",
    verify_checksums: bool | None = None, check_finite: bool = False, process_group=None, memory_limit: int | None = None, **remote
) -> dict[str, torch.Tensor]:
    """Load every tensor of a file, or of a checkpoint, as torch tensors.

    Parameters
    ----------
    filename : str or os.PathLike
        A ``.safetensors`` file, or a sharded checkpoint (its directory or its
        ``model.safetensors.index.json``), whose shards load as one (see
        :meth:`engine.checkpoints.checkpoint.Checkpoint.get_tensors`); or an ``http(s)://``, ``s3://``
        or other fsspec URL of a file, an index or a prefix, loaded by parallel ranged
        reads (:func:`engine.urls.remote_load.load`; ``backend`` does not apply).
    device : str, int or torch.device, default "cpu"
        Any torch device: CUDA loads stream through the native chunk ring (two copies: page
        cache to a page-locked chunk, DMA); other devices
        (``"mps"``, ``"xpu"``, ...) receive the CPU tensors through ``.to()``.
    backend : {"mmap", "pread"}
        ``"mmap"``: tensors view a private mapping (writable, copy-on-write);
        ``"pread"``: owned tensors filled by positional reads.
    process_group : torch.distributed.ProcessGroup, optional
        Every rank of the group calls this with the same ``filename``: each reads a share of
        the bytes and sends it to the others, so that the group reads the checkpoint once
        (:mod:`engine.apps.group_load`; a file, an index, a folder or a URL with its options;
        CPU tensors, or each its own allocation on a CUDA ``device``, the rounds sent between
        the GPUs over NCCL on an NCCL group).  ``torch.distributed.group.WORLD`` for every rank.
    verify_checksums : bool, optional
        Check every tensor against the CRC-32C its file records, where it records them
        (:mod:`engine.format.checksums`), before returning; default True.  A mismatch raises
        :class:`~engine.errors.ChecksumError` and nothing is returned.
    check_finite : bool, default False
        Fail with :class:`~engine.errors.NonFiniteError` (naming the tensor and the counts)
        when a floating tensor holds NaN or Inf, counted as the bytes land by the statistics
        kernels (needs Numba; one local file; owned tensors, as :func:`engine.stream` makes
        them, whatever ``backend``).
    memory_limit : int, optional
        Host bytes the load may hold beyond the tensors it returns (:mod:`engine.planning.memory`):
        a host load reads into its tensors and holds nothing more; a CUDA load of one file or a
        URL stages through the ring's page-locked chunks, sized from the limit (a checkpoint's
        folder or index through ``safe_open`` keeps the default ring: a limit below it is an
        :class:`~engine.errors.OptionError`); a group load's output is its only block.
    **remote
        For a URL only: ``headers``, ``timeout``, ``connections``, ``chunk_bytes``, ``retry``,
        ``s3``, ``storage_options``, ``cache_dir`` (a local copy written in the same pass,
        read by the next load; see :func:`engine.urls.remote_load.stream`).

    Returns
    -------
    dict of str to torch.Tensor, in file order (shard by shard); each tensor has its own
    storage.

    Notes
    -----
    Copies of tensor bytes on the CPU: 0 with "mmap", 1 with "pread".  On a CUDA device,
    whatever the backend: 2 (page cache to a page-locked chunk, then DMA); see
    :mod:`engine.loading.pipeline`.
    """
    if check_finite:
        from engine.loading.loader import load_finite

        return load_finite(filename, "pt", device, verify_checksums)
    if process_group is not None:
        from engine.apps.group_load import load as group_load

        return group_load(filename, process_group, device=device, verify_checksums=verify_checksums,
                          memory_limit=memory_limit, **remote)
    from engine.apps.entry_points import memory_limit as within

    limited = {"memory_limit": memory_limit}
    one_file = backend in ("mmap", "pread") and not is_url(filename) and not is_checkpoint_path(filename)
    within(limited, torch.device(device if not isinstance(device, int) else f"cuda:{device}").type == "cuda",
           sizes_ring=is_url(filename) or one_file)
    slot_bytes = limited.pop("slot_bytes", None)  # the device ring's chunks, sized from the limit
    if slot_bytes and is_url(filename):
        remote["slot_bytes"] = slot_bytes
    with verification(verify_checksums):
        if is_url(filename):  # parallel ranged reads straight into the tensors
            from engine.urls.remote_load import load

            return load(filename, "pt", device, **remote)
        if remote:
            raise TypeError(f"load_file() got options for a URL with a local path: {sorted(remote)}")
        sink = TorchSink(device)
        if one_file and (sink.on_device or backend == "pread"):
            # one file into owned or device memory: straight to the loader, no handle between
            from engine.loading.loader import load_file as load_one

            return load_one(filename, sink, slot_bytes=slot_bytes)
        with safe_open(filename, framework="pt", device=device, backend=backend) as f:
            return f.get_tensors()


def load(data: bytes) -> dict[str, torch.Tensor]:
    """Load tensors from the bytes of a whole safetensors file.

    Notes
    -----
    Copies of tensor bytes: 1.  ``bytes`` are immutable while torch tensors are writable, so
    the data region is copied once into one ``bytearray``; each tensor's storage covers its
    own range of it.
    """
    header = parse_buffer(data)
    # one owned copy of the data region (at least one byte: torch cannot wrap an empty buffer)
    owned = bytearray(memoryview(data)[header.data_start :]) or bytearray(1)
    sink = TorchSink()
    return views(sink, sink.map(owned), header.table, header.table.file_order(), 0)


def _check(tensors) -> None:
    if not isinstance(tensors, dict):
        raise SerializationError(f"expected a dict of str to torch.Tensor, got {type(tensors).__name__}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise SerializationError(f"tensor {name!r} is a {type(t).__name__}, expected torch.Tensor", tensors=(name,))


def save_file(tensors: dict, filename, metadata: dict[str, str] | None = None, *, checksums: bool = False) -> None:
    """Write torch tensors to ``filename`` atomically; see :func:`engine.writing.writer.save_file`
    (``checksums=True`` records every tensor's CRC-32C and the header's, verified by every load).

    Raises
    ------
    SharedTensorsError
        Tensors whose bytes overlap (a ``RuntimeError``, as the reference raises); use
        :func:`save_model` for models with tied weights.
    SerializationError
        Sparse or non-contiguous tensors, unknown dtypes (a ``ValueError``).
    """
    _check(tensors)
    writer.save_file(tensors, os.fspath(filename), metadata, checksums=checksums)


def save(tensors: dict, metadata: dict[str, str] | None = None, *, checksums: bool = False) -> bytes:
    """The bytes of a safetensors file holding ``tensors``; see :func:`engine.writing.writer.save`."""
    _check(tensors)
    return writer.save(tensors, metadata, checksums=checksums)


# -- storages -------------------------------------------------------------------------------


def storage_ptr(tensor: torch.Tensor) -> int:
    """Address of the first byte of ``tensor``'s storage (0 for storages without data)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # meta and other data-less storages
        return 0


def storage_size(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s storage (the tensor's own bytes where the storage has none)."""
    try:
        return tensor.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        return tensor.nelement() * tensor.element_size()


def _getdtype(dtype_str: str) -> torch.dtype:
    """torch dtype of a format dtype name (``"F32"``, ``"BF16"``, ...); ``KeyError`` for an
    unknown name.  The reference's helper of this name: ``torch.distributed.checkpoint``
    imports it from ``safetensors.torch``."""
    return dtypes.torch_dtype(dtypes.BY_NAME[dtype_str].code)


def _end_ptr(tensor: torch.Tensor) -> int:
    """One past the address of ``tensor``'s last element (its first for empty tensors)."""
    if not tensor.nelement():
        return tensor.data_ptr()
    last = sum((d - 1) * s for d, s in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.data_ptr() + (last + 1) * tensor.element_size()


def _is_complete(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` covers its whole storage, densely."""
    return tensor.data_ptr() == storage_ptr(tensor) and tensor.nelement() * tensor.element_size() == storage_size(
        tensor
    )


def _filter_shared_not_shared(groups: list[set[str]], state_dict: Mapping[str, torch.Tensor]) -> list[set[str]]:
    """Split each group of names on one storage into runs whose byte ranges overlap."""
    out: list[set[str]] = []
    for group in groups:
        if len(group) < 2:
            out.append(group)
            continue
        areas = sorted((state_dict[n].data_ptr(), _end_ptr(state_dict[n]), n) for n in group)
        _, last_stop, first = areas[0]
        out.append({first})
        for start, stop, name in areas[1:]:
            if start >= last_stop:
                out.append({name})
            else:
                out[-1].add(name)
            last_stop = stop
    return out


def _find_shared_tensors(state_dict: Mapping[str, torch.Tensor]) -> list[set[str]]:
    """Groups of names whose tensors share memory (one storage, overlapping bytes).

    Tensors on the meta device and tensors without storage bytes are left out; a tensor
    that shares nothing is a group of one.  Same grouping and order as the reference.
    """
    by_storage: dict[tuple, set[str]] = defaultdict(set)
    for name, t in state_dict.items():
        if t.device.type == "meta":
            continue
        ptr, size = storage_ptr(t), storage_size(t)
        if ptr != 0 and size != 0:
            # the device is part of the key: equal addresses on two GPUs are not shared
            by_storage[(t.device, ptr, size)].add(name)
    return _filter_shared_not_shared(sorted(by_storage.values()), state_dict)


def _remove_duplicate_names(
    state_dict: Mapping[str, torch.Tensor],
    *,
    preferred_names: list[str] | None = None,
    discard_names: list[str] | None = None,
) -> dict[str, list[str]]:
    """For each group of shared tensors, the name to keep -> the names to drop.

    The kept name covers its whole storage; among several, the first in sorted order,
    preferring names not in ``discard_names`` and then names in ``preferred_names``.

    Raises
    ------
    RuntimeError
        A group where no tensor covers the whole storage: saving one of them would store
        bytes nobody asked for.
    """
    preferred = set(preferred_names or ())
    discard = set(discard_names or ())
    to_remove: dict[str, list[str]] = defaultdict(list)
    for shared in _find_shared_tensors(state_dict):
        complete = {n for n in shared if _is_complete(state_dict[n])}
        if not complete:
            raise RuntimeError(
                f"cannot choose a name to keep among the tensors sharing memory {sorted(shared)}: none covers "
                "its whole storage, so saving one would store more bytes than it holds. Refusing to save/load "
                "the model; clone the tensors you want to keep"
            )
        keep = sorted(complete)[0]
        kept = complete - discard
        if kept:
            keep = sorted(kept)[0]
        if preferred & complete:
            keep = sorted(preferred & complete)[0]
        for name in sorted(shared):
            if name != keep:
                to_remove[keep].append(name)
    return to_remove


def save_model(
    model: torch.nn.Module, filename: str, metadata: dict[str, str] | None = None, force_contiguous: bool = True
) -> None:
    """Save a model's state dict, dropping duplicate names of shared (tied) tensors.

    Each dropped name is recorded in the metadata as ``{dropped: kept}`` (user keys win),
    as the reference does; :func:`load_model` restores the ties.

    Parameters
    ----------
    model : torch.nn.Module
    filename : str or os.PathLike
    metadata : dict of str to str, optional
    force_contiguous : bool, default True
        Save non-contiguous tensors from a contiguous copy instead of failing.

    Raises
    ------
    RuntimeError
        Shared tensors none of which covers its storage.
    ValueError
        A non-contiguous tensor with ``force_contiguous=False``.
    """
    state_dict = model.state_dict()
    for kept, dropped in _remove_duplicate_names(state_dict).items():
        for name in dropped:
            if metadata is None:
                metadata = {}
            metadata.setdefault(name, kept)
            del state_dict[name]
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    try:
        save_file(state_dict, filename, metadata=metadata)
    except SerializationError as exc:
        if exc.reason != "NonContiguous":
            raise
        raise SerializationError(
            f"{exc.message}. Or use save_model(..., force_contiguous=True), read the docs for potential caveats.",
            reason=exc.reason,
            path=exc.path,
            tensors=exc.tensors,
        ) from None


def load_model(
    model: torch.nn.Module,
    filename: str | os.PathLike,
    strict: bool = True,
    device: str | int = "cpu",
    *,
    backend: str = "mmap",
) -> tuple[set[str], list[str]]:
    """Load a file into ``model``, restoring tensors that the model shares.

    Returns
    -------
    (missing, unexpected)
        ``missing`` (a set, as the reference returns it): names of the model the file did
        not fill; ``unexpected`` (a list): names in the file the model does not use.  Names the model shares with a loaded name count as
        filled.

    Raises
    ------
    RuntimeError
        ``strict`` and some name is missing or unexpected, as ``load_state_dict`` words it.

    Notes
    -----
    Copies of tensor bytes: those of :func:`load_file`, plus ``load_state_dict``'s copy
    into the model's parameters.
    """
    state_dict = load_file(filename, device=device, backend=backend)
    to_removes = _remove_duplicate_names(model.state_dict(), preferred_names=list(state_dict))
    missing_keys, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = set(missing_keys)
    for names in to_removes.values():
        for name in names:
            if name not in missing:
                unexpected.append(name)
            else:
                missing.remove(name)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(error)
    return missing, unexpected


def deduplicate(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Make a torch state dict writable as safetensors: no shared bytes, all contiguous.

    Parameters
    ----------
    tensors : mapping of str to torch.Tensor

    Returns
    -------
    tensors : dict
        What to write.
    aliases : dict of str to str
        Dropped name -> kept name, for names that are the *same view* of the same memory
        (tied weights); the reference's ``save_model`` records these in the metadata too.
    copied : list of str
        Names written from a copy: non-contiguous tensors, and views that overlap another
        tensor's bytes without being identical to it (a slice of a kept tensor).

    Notes
    -----
    The kept name of a group of identical views is the first in sorted order.
    Unlike the reference's ``save_model``, partial views are kept (copied), not dropped, so
    every name of the input is in the output or in ``aliases``.
    """
    out: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    copied: list[str] = []
    groups: dict[tuple, list[str]] = {}
    for name, t in tensors.items():
        if t.device.type == "meta" or t.numel() == 0:
            out[name] = t
            continue
        key = (str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        groups.setdefault(key, []).append(name)
    for names in groups.values():
        t = tensors[names[0]]
        # identical views: all cover their storage or none does, so the reference's rule
        # (first sorted name among those covering it, else first sorted) is the first name
        keep = sorted(names)[0]
        for n in names:
            if n != keep:
                aliases[n] = keep
        out[keep] = t
    # views that overlap a kept tensor without being it: keep the bytes, as a copy
    spans = []
    for name, t in out.items():
        if t.numel() and t.device.type != "meta":
            spans.append((str(t.device), t.data_ptr(), _end_ptr(t), name))
    spans.sort()
    end_by_device: dict[str, int] = {}
    for device, start, end, name in spans:
        if start < end_by_device.get(device, -1):
            out[name] = out[name].clone()
            copied.append(name)
        else:
            end_by_device[device] = max(end, end_by_device.get(device, -1))
    for name, t in out.items():
        if not t.is_contiguous():
            out[name] = t.contiguous()
            if name not in copied:
                copied.append(name)
    return {n: out[n] for n in tensors if n in out}, aliases, copied
