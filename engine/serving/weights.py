"""What an inference server's loader hands to the model: ``(name, tensor)`` pairs read by the
engine, the options that steer it, and the check that every parameter was loaded.

No server is imported here; :mod:`engine.serving.vllm` and :mod:`engine.serving.sglang` wrap
:class:`Weights` in their server's loader interface.

Where the tensors come from
---------------------------
``source`` is a local checkpoint (a directory, a ``*.safetensors.index.json`` or one file) or
an ``http(s)://`` / ``s3://`` URL of one (a file, an index or a prefix).  A directory is read
as vLLM reads it: the shards its ``model.safetensors.index.json`` names (the index checked
against their headers), else every ``*.safetensors`` file in it.

How they are handed out, and the copies of their bytes
------------------------------------------------------
* **CUDA** (``device="cuda:N"``): :func:`engine.stream` over every shard as one load, through
  the native chunk ring; tensors in the order they land.  2 copies (page cache to a
  page-locked chunk, DMA to the device), then the server's own copy into its parameter on the
  device.  ``per_tensor`` (the default) gives each tensor its own device allocation, freed as
  soon as the server has copied it, instead of one allocation that would hold a second copy
  of the whole model on the device until the end.
* **CPU, ``cpu="view"``** (the default): zero-copy views of a private (copy-on-write) mapping
  of each shard, read ahead on several threads when the file is cold.  0 copies here: the
  server's copy into its parameter is the only one, as with the reference ``safe_open``.
* **CPU, ``cpu="owned"``**: :func:`engine.stream` into owned memory, 1 copy (page cache to the
  tensor) before the server's; for files that may change while the server loads them.
* **A URL**: :func:`engine.urls.remote_load.stream`, parallel ranged reads straight into the
  tensors (CPU 1 copy, CUDA 2), with ``cache_dir`` a local copy written in the same pass and
  read by the next load.

The rule for views
------------------
A view shows the file's bytes through a private mapping, which the kernel keeps in step with
the file (a rewrite shows through; a truncation makes a read raise SIGBUS, even of a page
the process wrote).  A server's weight loader copies what it is handed into its parameters,
and then the mapping is dropped.  A weight loader that *keeps* a tensor instead (an alias in
a parameter, a buffer) must never see its bytes change afterwards, so when the iteration is
closed (:meth:`Weights.close`, at the end of the server's ``load_weights``) every shard whose
mapping is still referenced is detached from its file on the spot: its bytes are copied into
fresh anonymous memory that ``mremap`` moves to the mapping's address, under the kept
tensors (one copy of that shard).  From then on a file rewritten or truncated changes
nothing and cannot raise SIGBUS.  While the load runs the files must not be truncated (as
with the reference's mapping); ``cpu="owned"`` is the choice where they can be.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import mmap
import os
import re
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from engine.base._files import PREFETCH_MIN_BYTES, is_url, on_network_mount, open_regular
from engine.checkpoints.checkpoint_info import INDEX_NAME, missing_shard, resolve
from engine.errors import OptionError, SafetensorError, TensorNotFoundError
from engine.format.checkpoint_index import index_problems
from engine.format.header import MAX_HEADER_SIZE, read_header, read_header_fd

__all__ = ["Options", "parse_options", "checkpoint_files", "Weights", "missing_parameters", "check_loaded",
           "OPTION_DOCS", "tp_group_of", "stage_select"]

logger = logging.getLogger("engine.serving")

#: every option a server's loader takes, with what it does (``--model-loader-extra-config``)
OPTION_DOCS: dict[str, str] = {
    "weights": "path or http(s):// / s3:// URL of the weights, when they are not where the model's "
               "config is (default: the model's own path, or vLLM's model_weights)",
    "cpu": '"view" (default: zero-copy views of a private mapping) or "owned" (owned memory, 1 copy)',
    "threads": "native threads of the load (default: every core)",
    "chunk_bytes": "bytes per read request (an int or a size such as \"16MiB\")",
    "slot_bytes": "CUDA: bytes per page-locked chunk of the ring (an int or a size)",
    "per_tensor": "CUDA: one device allocation per tensor, freed once copied (default true)",
    "cache_dir": "URL weights: keep a local copy there, read by the next load",
    "connections": "URL weights: parallel requests",
    "timeout": "URL weights: seconds per request",
    "headers": "URL weights: HTTP headers sent with every request (an object of strings)",
    "s3": "URL weights: endpoint_url, region, profile, anonymous",
    "max_header_size": "largest header (and index) accepted, in bytes",
    "stats": "log one line of what the load did: tensors, bytes, seconds, GB/s (default false)",
    "memory_limit": "host bytes the load may hold beyond the tensors it hands out (an int or a size such as "
                    "\"256MiB\"; 0: the largest tensor); default: the load's own plan",
    "distributed": "the server's tensor-parallel workers read the checkpoint once between them and send each "
                   "other the bytes (engine.apps.group_load, over the group's gloo side); default: on for URL "
                   "weights on the CPU when there is more than one worker and no cache_dir (with one, each "
                   "worker would write a whole copy)",
}

_REMOTE_ONLY = ("cache_dir", "connections", "timeout", "headers", "s3")
_S3_KEYS = frozenset({"endpoint_url", "region", "profile", "anonymous"})


@dataclasses.dataclass(frozen=True)
class Options:
    """The loader's options, checked (see :data:`OPTION_DOCS`)."""

    weights: str | None = None
    cpu: str = "view"
    threads: int | None = None
    chunk_bytes: int | None = None
    slot_bytes: int | None = None
    per_tensor: bool = True
    cache_dir: str | None = None
    connections: int | None = None
    timeout: float | None = None
    headers: dict[str, str] | None = None
    s3: dict[str, Any] | None = None
    max_header_size: int = MAX_HEADER_SIZE
    stats: bool = False
    distributed: bool | None = None
    memory_limit: int | None = None

    def remote(self) -> dict[str, Any]:
        """The options of :func:`engine.urls.remote_load.stream` that were given."""
        out = {k: getattr(self, k) for k in _REMOTE_ONLY if getattr(self, k) is not None}
        out["max_header_size"] = self.max_header_size
        return out


def _bad(option: str, value: Any, expected: str) -> OptionError:
    return OptionError(f"option {option!r}: expected {expected}, got {value!r}", option=option)


def _positive_int(option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(option, value, "a positive integer")
    return value


def _size(option: str, value: Any) -> int:
    if isinstance(value, str):
        from engine.checkpoints.shards import parse_size

        try:
            return parse_size(value)
        except SafetensorError as err:
            raise OptionError(f"option {option!r}: {err.message}", option=option) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(option, value, 'a positive number of bytes (an int, or a size such as "16MiB")')
    return value


def _flag(option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(option, value, "true or false")
    return value


def _text(option: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(option, value, "a non-empty string")
    return value


def parse_options(extra: Mapping[str, Any] | None, *, where: str = "--model-loader-extra-config") -> Options:
    """Check a server's loader options and return them as :class:`Options`.

    Parameters
    ----------
    extra : mapping or None
        The JSON object a user passed (vLLM's ``model_loader_extra_config``).
    where : str
        How the user passed it, for messages.

    Raises
    ------
    OptionError
        (a ``ValueError``) naming the option: one this loader does not know (with the known
        ones), or a value of the wrong type or range.
    """
    if extra is None:
        return Options()
    if not isinstance(extra, Mapping):
        raise OptionError(f"{where} must be a JSON object, got {type(extra).__name__}", option=where)
    unknown = sorted(k for k in extra if k not in OPTION_DOCS)
    if unknown:
        import difflib

        close = difflib.get_close_matches(str(unknown[0]), list(OPTION_DOCS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise OptionError(f"unknown option {unknown[0]!r} in {where}{hint} (known: {', '.join(OPTION_DOCS)})",
                          option=str(unknown[0]))
    kw: dict[str, Any] = {}
    for key, value in extra.items():
        if value is None:
            continue  # JSON null: the default
        if key in ("weights", "cache_dir"):
            kw[key] = _text(key, value)
        elif key == "cpu":
            if value not in ("view", "owned"):
                raise _bad(key, value, '"view" or "owned"')
            kw[key] = value
        elif key in ("threads", "connections", "max_header_size"):
            kw[key] = _positive_int(key, value)
        elif key in ("chunk_bytes", "slot_bytes"):
            kw[key] = _size(key, value)
        elif key == "memory_limit":
            kw[key] = 0 if value == 0 and not isinstance(value, bool) else _size(key, value)
        elif key in ("per_tensor", "stats", "distributed"):
            kw[key] = _flag(key, value)
        elif key == "timeout":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise _bad(key, value, "a positive number of seconds")
            kw[key] = float(value)
        elif key == "headers":
            if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                raise _bad(key, value, "an object of strings")
            kw[key] = dict(value)
        elif key == "s3":
            if not isinstance(value, Mapping) or not set(value) <= _S3_KEYS:
                raise _bad(key, value, f"an object with keys among {sorted(_S3_KEYS)}")
            kw[key] = dict(value)
    return Options(**kw)


def checkpoint_files(path: str | os.PathLike[str], *, max_header_size: int = MAX_HEADER_SIZE) -> list[str]:
    """The safetensors files of a local checkpoint, as vLLM chooses them.

    A directory: the shards its ``model.safetensors.index.json`` names, else every
    ``*.safetensors`` file in it (sorted).  An index file: its shards.  A file: itself.
    An index is checked against its shards' headers (a tensor missing from its shard, a
    shard's tensor the index does not list, a name in two shards).

    Raises
    ------
    SafetensorError
        ``reason="NoCheckpoint"``: a directory with no safetensors file.
    CheckpointIndexError, MissingShardError, HeaderError
        The index is malformed or disagrees with its shards; a shard is missing; a header
        is invalid.
    FileNotFoundError
        ``path`` does not exist.
    """
    spath = os.fspath(path)
    if os.path.isdir(spath):
        index = os.path.join(spath, INDEX_NAME)
        if not os.path.isfile(index):
            names = sorted(e for e in os.listdir(spath) if e.endswith(".safetensors") and not e.startswith("."))
            if not names:
                raise SafetensorError("the directory holds no safetensors file", reason="NoCheckpoint", path=spath)
            return [os.path.join(spath, n) for n in names]
        spath = index
    elif not os.path.exists(spath):
        raise FileNotFoundError(2, "no such checkpoint", spath)
    layout = resolve(spath)
    if layout.index_path is None:
        return [os.path.join(layout.directory, f) for f in layout.files]
    from engine.format.checkpoint_index import read_index

    _, weight_map = read_index(layout.index_path, max_header_size)
    shards = sorted(set(weight_map.values()))
    headers = {}
    for shard in shards:
        try:
            headers[shard] = read_header(os.path.join(layout.directory, shard), max_header_size=max_header_size)
        except FileNotFoundError as exc:
            raise missing_shard(shard, layout, exc) from None
    problems = index_problems(weight_map, headers, layout.index_path)
    if problems:
        raise problems[0]
    return [os.path.join(layout.directory, s) for s in shards]


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FAILED = 2**64 - 1


def _privatize(mapping: mmap.mmap) -> None:
    """Detach a private file mapping from its file, in place: its bytes are copied into fresh
    anonymous memory, which ``mremap`` then moves to the mapping's address (the page tables
    move, the bytes do not).  Writing the pages would not do: a truncated file takes even a
    private mapping's copied pages away (SIGBUS on the next read).  One copy of the file's
    bytes; the mapping object unmaps the anonymous memory when it goes, as it would have
    unmapped the file's."""
    import ctypes

    if mapping.closed:
        return
    size = len(mapping)
    span = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's address (an export, dropped below)
    addr = ctypes.addressof(anchor)
    del anchor
    libc = _libc()
    fresh = libc.mmap(None, span, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if fresh is None or fresh == _MAP_FAILED:
        raise OSError(ctypes.get_errno(), f"mmap of {span} bytes: {os.strerror(ctypes.get_errno())}")
    ctypes.memmove(fresh, addr, size)
    moved = libc.mremap(fresh, span, span, _MREMAP_MAYMOVE | _MREMAP_FIXED, addr)
    if moved is None or moved == _MAP_FAILED:
        err = ctypes.get_errno()
        libc.munmap(fresh, span)
        raise OSError(err, f"mremap of {span} bytes: {os.strerror(err)}")


class Weights:
    """``(name, tensor)`` of every tensor of a checkpoint, as a server's ``load_weights`` takes
    them (see the module documentation for where they come from and the copies).

    Use once, as a context manager around the server's ``load_weights``::

        with Weights(path, device="cpu") as weights:
            loaded = model.load_weights(weights)

    Parameters
    ----------
    source : str or os.PathLike
        A local checkpoint (directory, index or file) or a URL.
    device : str or torch.device, default "cpu"
        Where the tensors are handed out: ``"cpu"`` or a CUDA device.
    options : Options, optional
    group : torch.distributed.ProcessGroup, optional
        The server's tensor-parallel workers (a group whose backend moves CPU tensors: gloo),
        every one of which iterates its own ``Weights`` over the same source.  With the
        ``distributed`` option (default: on for URL weights on the CPU, when the group has more
        than one rank and there is no ``cache_dir``) the workers read the checkpoint once between
        them (:func:`engine.apps.group_load.stream`): host tensors, 1 copy (the read, or the
        collective's receive) before the server's own; every worker must iterate to the end.
        The tensors are views of one block per round of the exchange, which lives as long as
        a tensor of it does: a server that copies what it is handed holds the rounds in flight
        (``memory_limit``), not the checkpoint.
        With ``"distributed": true`` and ``cache_dir`` each worker writes a whole copy.
    select : callable, optional
        ``select(name)``: whether to read a tensor at all (the others are never read); the
        same on every worker of ``group``.  A pipeline stage's (:func:`stage_select`).

    Raises
    ------
    OptionError
        An option for URL weights (``cache_dir``, ``connections``, ...) with a local source.

    Notes
    -----
    After the iteration, ``tensors``, ``nbytes``, ``files`` and ``seconds`` say what was
    handed out; ``kept`` lists the shards whose mapping was still referenced at
    :meth:`close` and was made private (see "The rule for views").
    """

    def __init__(self, source: str | os.PathLike[str], *, device: Any = "cpu", options: Options | None = None,
                 group: Any = None, select: Callable[[str], bool] | None = None) -> None:
        self.source = os.fspath(source)
        self.select = select
        self.options = options or Options()
        self.device = str(device)
        self.remote = is_url(self.source)
        if not self.remote:
            given = [k for k in _REMOTE_ONLY if getattr(self.options, k) is not None]
            if given:
                raise OptionError(f"option {given[0]!r} applies to http(s):// and s3:// weights, and the weights are "
                                  f"the local path {self.source!r}", option=given[0])
        self.on_cuda = self.device.startswith("cuda")
        self.group = group if group is not None and self._ranks(group) > 1 and (
            self.options.distributed or (self.options.distributed is None and self.remote and not self.on_cuda
                                         and self.options.cache_dir is None)) else None
        self.mode = "group" if self.group is not None else "remote" if self.remote else "ring" if self.on_cuda \
            else self.options.cpu
        self.tensors = 0
        self.nbytes = 0
        self.files = 0
        self.seconds = 0.0
        self.kept: list[str] = []
        self._mappings: list[tuple[str, weakref.ref]] = []
        self._started: float | None = None
        self._iterator: Iterator[tuple[str, Any]] | None = None

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[str, Any]]:
        if self._iterator is not None:
            raise RuntimeError("a Weights is iterated once")
        self._started = time.perf_counter()
        self._iterator = self._generate()
        return self._iterator

    def _generate(self) -> Iterator[tuple[str, Any]]:
        for name, tensor in self._tensors():
            self.tensors += 1
            self.nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    @staticmethod
    def _ranks(group) -> int:
        import torch.distributed as dist

        return dist.get_world_size(group)

    def _tensors(self) -> Iterator[tuple[str, Any]]:
        o = self.options
        if self.group is not None:
            from engine.apps.group_load import stream as group_stream

            remote = {k: v for k, v in o.remote().items() if k != "max_header_size"} if self.remote else {}
            yield from group_stream(self.source, self.group, framework="pt", max_header_size=o.max_header_size,
                                    chunk_bytes=o.chunk_bytes, memory_limit=o.memory_limit, _select=self.select,
                                    **remote)
            return
        if self.remote:
            from engine.urls.remote_load import stream as remote_stream

            yield from remote_stream(self.source, framework="pt", device=self.device, chunk_bytes=o.chunk_bytes,
                                     **self._selected(), **self._device_options(), **o.remote())
            return
        files = checkpoint_files(self.source, max_header_size=o.max_header_size)
        self.files = len(files)
        if self.mode == "view":
            yield from self._views(files)
            return
        from engine.loading.loader import stream

        yield from stream(files, framework="pt", device=self.device, max_header_size=o.max_header_size,
                          chunk_bytes=o.chunk_bytes, **self._selected(), **self._device_options())

    def _selected(self) -> dict[str, Any]:
        return {} if self.select is None else {"predicate": self.select}

    def _device_options(self) -> dict[str, Any]:
        o = self.options
        out: dict[str, Any] = {"threads": o.threads}
        if self.on_cuda:
            out.update(per_tensor=o.per_tensor, slot_bytes=o.slot_bytes)
            if o.memory_limit is not None:  # the ring's chunks sized within the limit
                from engine.apps.entry_points import memory_limit

                memory_limit(limited := {"memory_limit": o.memory_limit, "slot_bytes": o.slot_bytes}, True)
                out["slot_bytes"] = limited.get("slot_bytes")
        return out

    def _views(self, files: list[str]) -> Iterator[tuple[str, Any]]:
        from engine.io.reader import prefetch_mapping
        from engine.loading.handle_reads import views
        from engine.sinks import get_sink, map_file

        sink = get_sink("torch", "cpu")
        for path in files:
            fd = open_regular(path)
            try:
                header = read_header_fd(fd, path=path, file_size=os.fstat(fd).st_size,
                                        max_header_size=self.options.max_header_size)
                network = on_network_mount(fd)
                mapping = map_file(sink, fd)  # outlives the descriptor
            finally:
                os.close(fd)
            self._mappings.append((path, weakref.ref(mapping)))
            table, start = header.table, header.data_start
            rows = [r for r in table.file_order() if self.select is None or self.select(table.names[r])]
            spans = [(start + int(table.begins[r]), start + int(table.ends[r])) for r in rows]
            if not network and sum(hi - lo for lo, hi in spans) >= PREFETCH_MIN_BYTES:
                # a cold shard is read on several threads in large pieces rather than one fault
                # at a time as the server's copies touch it; a warm one costs a few mincore calls
                prefetch_mapping(mapping, spans, threads=self.options.threads)
            tensors = views(sink, sink.map(mapping), header.table, rows, start, path=path)
            del mapping
            for name in list(tensors):
                # popped: once handed out, only the server holds the view (and so the mapping)
                yield name, tensors.pop(name)

    # -- the end of a load ----------------------------------------------------------------------
    def close(self) -> None:
        """End the iteration (the engine's threads stop, files close) and apply the rule for
        views: a shard whose mapping is still referenced is made private."""
        if self._iterator is not None:
            close = getattr(self._iterator, "close", None)
            if close is not None:
                close()
        if self._started is not None and not self.seconds:
            self.seconds = time.perf_counter() - self._started
        if self._mappings:
            alive = [(p, r) for p, r in self._mappings if r() is not None]
            if alive:
                gc.collect()  # a view held only by a dead reference cycle is no reference
            for path, ref in alive:
                mapping = ref()
                if mapping is not None:
                    _privatize(mapping)
                    self.kept.append(path)
                del mapping
            self._mappings = []

    def __enter__(self) -> Weights:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def summary(self) -> str:
        """One line: what the load handed out, how, and how fast."""
        rate = self.nbytes / self.seconds / 1e9 if self.seconds else 0.0
        files = f" from {self.files} files" if self.files else ""
        kept = f"; {len(self.kept)} shards kept by the model were made private" if self.kept else ""
        return (f"safetensors-engine ({self.mode}, {self.device}): {self.tensors} tensors, "
                f"{self.nbytes / 1e9:.3f} GB{files} in {self.seconds:.3f} s ({rate:.2f} GB/s){kept}")


def tp_group_of(parallel_state: Any) -> Any:
    """The gloo side (``cpu_group``) of a server's tensor-parallel group, from its
    ``parallel_state`` module (vLLM's, or SGLang's fork of it), or None where its distributed
    state is not set up or the group has one worker."""
    group = getattr(parallel_state, "_TP", None)
    if group is None and getattr(parallel_state, "_WORLD", None) is not None:  # distributed, but no TP group
        logger.warning("no tensor-parallel group in %s: each worker reads the whole checkpoint on its own",
                       getattr(parallel_state, "__name__", "the server's parallel state"))
    if group is None or getattr(group, "world_size", 1) < 2:
        return None
    return group.cpu_group


#: where a name holds a layer's index: ``...layers.{i}.``
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def stage_select(parameters: Iterable[str]) -> Callable[[str], bool]:
    """Which checkpoint tensors a pipeline stage reads, from the names of its model's
    parameters and buffers: a stage holds its own layers only (the others have no
    parameters), so a tensor of ``layers.{i}`` is read where the model holds some parameter of
    ``layers.{i}`` under the same prefix; every other tensor (embeddings, norms, heads, and
    layers under a prefix the model does not name or names twice) is read by every stage."""
    held: dict[str, set[int]] = {}
    for name in parameters:
        m = _LAYER.search(name)
        if m is not None:
            held.setdefault(name[: m.start(1)], set()).add(int(m.group(1)))

    def select(name: str) -> bool:
        m = _LAYER.search(name)
        if m is None:
            return True
        prefix = name[: m.start(1)]
        layers = held.get(prefix)
        if layers is None:  # the checkpoint's prefix and the model's differ: one match by suffix, or read it
            near = [p for p in held if p.endswith("." + prefix) or prefix.endswith("." + p)]
            if len(near) != 1:
                return True
            layers = held[near[0]]
        return int(m.group(1)) in layers

    return select


def missing_parameters(parameters: Iterable[str], loaded: Iterable[str], exempt: Iterable[str] = ()) -> list[str]:
    """The parameter names that neither ``loaded`` (what the server's ``load_weights``
    reported) nor ``exempt`` (parameters no checkpoint carries) holds, in the order of
    ``parameters``."""
    done = set(loaded) | set(exempt)
    return [p for p in parameters if p not in done]


def check_loaded(parameters: Iterable[str], loaded: Iterable[str], exempt: Iterable[str] = (), *,
                 source: str | None = None) -> None:
    """Raise when a parameter of the model was not loaded from the checkpoint.

    Raises
    ------
    TensorNotFoundError
        ``reason="MissingWeights"``, ``.tensors`` the parameters not loaded (the message names
        the first 20).
    """
    missing = missing_parameters(parameters, loaded, exempt)
    if missing:
        shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise TensorNotFoundError(
            f"{len(missing)} parameter(s) of the model are not in the checkpoint: {shown}",
            reason="MissingWeights", path=source, tensors=missing,
        )
