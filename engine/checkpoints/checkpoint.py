"""Sharded checkpoints: ``model.safetensors.index.json`` and its shards as one checkpoint.

Hugging Face tools save a large model as shards ``model-00001-of-00004.safetensors`` ...
plus an index ``model.safetensors.index.json``::

    {"metadata": {"total_size": 123}, "weight_map": {"tensor name": "shard file name", ...}}

and a small one as a single ``model.safetensors`` with no index.  This module reads both
as one logical checkpoint (:func:`open_checkpoint`, :func:`read_checkpoint_info`);
:mod:`engine.checkpoints.shards` writes them (:func:`~engine.checkpoints.shards.save_sharded`, also importable from
here) with the file names, shard split and index JSON of ``huggingface_hub``/``transformers``.

The index is checked as strictly as a header (:mod:`engine.format.checkpoint_index`); a
checkpoint's contents are read from its headers alone by :mod:`engine.checkpoints.checkpoint_info`.
Their public names stay importable from here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from engine.checkpoints.checkpoint_info import (
    INDEX_NAME,
    SAFETENSORS_NAME,
    CheckpointInfo,
    PathLike,
    check_checkpoint,
    map_shards,
    missing_shard,
    open_layout,
    read_checkpoint_info,
)
from engine.errors import CheckpointIndexError, MissingShardError
from engine.format.checkpoint_index import check_shard_name, index_problems, parse_index
from engine.format.header import MAX_HEADER_SIZE
from engine.loading import file_handle, handle_reads

# the writing half lives in engine.checkpoints.shards; its names stay importable from here, imported on
# first use so that opening a checkpoint loads no writer
_FROM_SHARDS = frozenset(
    {"FILENAME_PATTERN", "ShardSplit", "index_json", "parse_size", "save_sharded", "split_into_shards"}
)


def __getattr__(name: str):
    if name in _FROM_SHARDS:
        from engine.checkpoints import shards

        return getattr(shards, name)
    raise AttributeError(f"module 'engine.checkpoints.checkpoint' has no attribute {name!r}")

__all__ = [
    "SAFETENSORS_NAME",
    "INDEX_NAME",
    "CheckpointIndexError",
    "MissingShardError",
    "CheckpointInfo",
    "Checkpoint",
    "open_checkpoint",
    "read_checkpoint_info",
    "check_checkpoint",
    "parse_index",
    "index_problems",
    "check_shard_name",
]



# --------------------------------------------------------------------------- reading


class Checkpoint:
    """A checkpoint (one file, or an index and its shards) open for reading; see
    :func:`open_checkpoint`.  The API of :class:`engine.safe_open`, across shards."""

    def __init__(
        self,
        path: PathLike,
        framework: str = "numpy",
        device: Any = "cpu",
        *,
        backend: str = "mmap",
        max_header_size: int = MAX_HEADER_SIZE,
        max_workers: int | None = None,
        verify_checksums: bool | None = None,
    ) -> None:
        layout, metadata, weight_map = open_layout(path, max_header_size)
        self._layout = layout
        self._handles: dict[str, Any] = {}

        def open_one(shard: str):
            try:
                return file_handle.safe_open(
                    os.path.join(layout.directory, shard),
                    framework=framework,
                    device=device,
                    backend=backend,
                    max_header_size=max_header_size,
                    verify_checksums=verify_checksums,
                )
            except FileNotFoundError as exc:
                if layout.index_path is None:
                    raise
                raise missing_shard(shard, layout, exc) from None

        opened = map_shards(open_one, layout.files, max_workers, undo=lambda handle: handle.close())
        self._handles = dict(zip(layout.files, opened, strict=True))
        headers = {shard: h.header for shard, h in self._handles.items()}
        if layout.index_path is not None:
            problems = index_problems(weight_map, headers, layout.index_path)
            if problems:
                self.close()
                raise problems[0]
            self.info = CheckpointInfo(
                layout.source, headers, index=layout.index_path, index_metadata=metadata, weight_map=weight_map,
                directory=layout.directory,
            )
        else:
            self.info = CheckpointInfo(layout.source, headers, directory=layout.directory)

    # -- context manager ---------------------------------------------------------------
    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close every shard; tensors already handed out stay valid."""
        for h in self._handles.values():
            h.close()

    # -- the reference's API -------------------------------------------------------------
    def keys(self) -> list[str]:
        """Tensor names across all shards, sorted."""
        return self.info.keys()

    def offset_keys(self) -> list[str]:
        """Tensor names shard by shard (sorted shards), in file order within each."""
        return [info.name for _, info in self.info.tensors()]

    def metadata(self) -> dict[str, str] | None:
        """``__metadata__`` entries common to every shard; see :meth:`CheckpointInfo.metadata`.

        The index's own ``metadata`` (``total_size``) is :attr:`index_metadata`.
        """
        return self.info.metadata()

    @property
    def index_metadata(self) -> dict[str, Any] | None:
        return self.info.index_metadata

    @property
    def weight_map(self) -> dict[str, str]:
        return dict(self.info.weight_map)

    @property
    def shards(self) -> list[str]:
        """Shard file names, sorted; the paths are relative to the index's directory."""
        return self.info.shards

    def handle(self, shard: str):
        """The :class:`engine.safe_open` handle of one shard."""
        return self._handles[shard]

    def __len__(self) -> int:
        return len(self.info)

    def __contains__(self, name: object) -> bool:
        return name in self.info

    def get_tensor(self, name: str):
        """The whole tensor ``name``, from its shard (a view for "mmap", owned for "pread")."""
        return self._handles[self.info.shard_of(name)].get_tensor(name)

    def get_slice(self, name: str):
        """A lazy slice handle on ``name`` in its shard (reads only what is indexed)."""
        return self._handles[self.info.shard_of(name)].get_slice(name)

    def get_tensors(self, names: Iterable[str] | None = None) -> dict:
        """Every tensor (or those in ``names``), every shard in one load.

        Parameters
        ----------
        names : iterable of str, optional
            The tensors to load; all of them when omitted.

        Returns
        -------
        dict
            Name to tensor, shard by shard (sorted shards), file order within a shard when
            ``names`` is omitted, else the order of ``names``.

        Raises
        ------
        TensorNotFoundError
            A name the checkpoint does not hold.
        ReadError
            A shard could not be read (``"pread"`` backend).

        Notes
        -----
        ``"mmap"`` on the CPU makes views of each shard's mapping, read ahead on several
        threads when cold.  Owned (``"pread"``) and device loads read every shard through
        one pipeline (one queue of reads over all files, one set of reader threads or
        one chunk ring, one allocation) instead of one per shard.
        Copies of tensor bytes as for :class:`engine.safe_open`: 0 with ``"mmap"``, 1 with
        ``"pread"``; on a device 2 (page cache to a page-locked chunk, DMA).
        """
        if names is None:
            parts = [(self._handles[s], self.info.headers[s].table.file_order()) for s in self.shards]
            wanted = None
        else:
            wanted = list(names)
            by_shard: dict[str, dict[int, None]] = {}  # ordered sets: a name asked twice is read once
            for name in wanted:
                shard = self.info.shard_of(name)
                by_shard.setdefault(shard, {})[self.info.headers[shard].table.index[name]] = None
            parts = [(self._handles[s], list(rows)) for s, rows in by_shard.items()]
        loaded: dict = {}
        for part in handle_reads.get_rows_many(parts):
            loaded.update(part)
        return loaded if wanted is None else {n: loaded[n] for n in wanted}

    def load_into(
        self,
        tensors: Mapping[str, Any],
        *,
        strict: bool = False,
        threads: int | None = None,
        chunk_bytes: int | None = None,
        gpu_path: str = "auto",
    ) -> list[str]:
        """Fill existing tensors in place from every shard, as one load; see
        :func:`engine.load_into`.

        Returns
        -------
        list of str
            The names filled, shard by shard (sorted shards), in file order within each.
        """
        return handle_reads.load_into_many(
            [self._handles[s] for s in self.shards], tensors, strict=strict, threads=threads,
            chunk_bytes=chunk_bytes, gpu_path=gpu_path, source=self.info.source,
        )

    def __repr__(self) -> str:
        return f"<engine.Checkpoint {self.info.source!r}: {len(self)} tensors in {len(self.shards)} files>"


def open_checkpoint(
    path: PathLike,
    framework: str = "numpy",
    device: Any = "cpu",
    *,
    backend: str = "mmap",
    max_header_size: int = MAX_HEADER_SIZE,
    max_workers: int | None = None,
) -> Checkpoint:
    """Open a single file, an index, or a directory as one checkpoint.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.safetensors`` file, a ``*.safetensors.index.json``, or a directory (see
        :func:`read_checkpoint_info` for how one is chosen).
    framework : {"np", "numpy", "pt", "torch"}
        Kind of tensors handed out.
    device : str, int or torch.device, default "cpu"
        As for :class:`engine.safe_open`.
    backend : {"mmap", "pread"}, default "mmap"
        As for :class:`engine.safe_open`, for every shard.
    max_header_size : int, optional
        Largest header per shard, and largest index file, in bytes.
    max_workers : int, optional
        Threads opening shards (default: up to 8).  Loads need none of their own:
        :meth:`Checkpoint.get_tensors` reads every shard through one pipeline.

    Returns
    -------
    Checkpoint
        ``keys()``, ``metadata()``, ``get_tensor``, ``get_slice`` and ``get_tensors`` as on
        :class:`engine.safe_open`, routed to the right shard; a context manager.

    Raises
    ------
    CheckpointIndexError
        The index is malformed, names an unsafe shard path, or disagrees with the shards:
        a listed tensor absent from its shard, a shard's tensor absent from the index, one
        name in two shards.
    MissingShardError
        A shard named by the index does not exist (also a ``FileNotFoundError``).
    HeaderError
        A shard's header is invalid.
    OSError
        As ``open`` raises them.

    Notes
    -----
    Opening reads the index and every shard's header (``8 + N`` bytes each, shards in
    parallel) and keeps one file descriptor per shard open until :meth:`Checkpoint.close`.
    Copies of tensor bytes: as for :class:`engine.safe_open`.

    Examples
    --------
    >>> with open_checkpoint("Llama-3-8B/", framework="pt") as ckpt:  # doctest: +SKIP
    ...     w = ckpt.get_tensor("model.embed_tokens.weight")
    ...     state = ckpt.get_tensors()
    """
    return Checkpoint(
        path, framework, device, backend=backend, max_header_size=max_header_size, max_workers=max_workers
    )
