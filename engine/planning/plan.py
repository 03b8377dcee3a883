"""Read plans: which byte ranges of a file a request needs.

A plan is computed from header numbers alone and never touches the file.  This module
holds the slicing logic shared by every backend: an index such as ``t[2:10, ::4]`` is
turned into the list of contiguous byte runs it covers, so a reader fetches exactly
those bytes (a row block is one run, a column block a set of strided runs).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np

from engine.errors import InvalidSliceError

__all__ = ["SlicePlan", "plan_slice", "InvalidSliceError"]


class SlicePlan(NamedTuple):
    """How to read ``tensor[index]`` from a C-contiguous tensor stored at byte 0.

    ``out_shape`` is the shape of the dense block that the runs fill, in order: run ``i``
    starts at byte ``src[i]`` of the tensor and has ``run_bytes`` bytes; runs are laid end to
    end in the destination.  ``squeeze`` names the axes indexed by an integer (dropped
    after reading) and ``flip`` those with a negative step (reversed after reading, since
    runs are always read forwards).
    """

    out_shape: tuple[int, ...]
    src: np.ndarray  # int64 byte offsets of each run, relative to the tensor's first byte
    run_bytes: int
    squeeze: tuple[int, ...]
    flip: tuple[int, ...]
    #: the same selection with every step positive (ints for squeezed axes), for backends
    #: that slice a view instead of reading runs; apply ``flip`` afterwards
    forward_index: tuple

    @property
    def nbytes(self) -> int:
        return int(self.src.size) * self.run_bytes

    @property
    def flip_squeezed(self) -> tuple[int, ...]:
        """``flip`` renumbered for the array with the ``squeeze`` axes already dropped."""
        return tuple(a - sum(1 for s in self.squeeze if s < a) for a in self.flip)

    @property
    def result_shape(self) -> tuple[int, ...]:
        return tuple(n for axis, n in enumerate(self.out_shape) if axis not in self.squeeze)


def _normalize(index, shape: tuple[int, ...], strict_bounds: bool = False):
    """Per-axis (start, count, step>0, squeezed, flipped) with numpy's semantics; with
    ``strict_bounds`` a slice bound past its axis is an error instead of being clamped."""
    if not isinstance(index, tuple):
        index = (index,)
    n_ellipsis = sum(1 for ix in index if ix is Ellipsis)
    if n_ellipsis > 1:
        raise InvalidSliceError("an index can only have a single ellipsis ('...')")
    explicit = len(index) - n_ellipsis
    if explicit > len(shape):
        raise InvalidSliceError(f"too many indices for a tensor of {len(shape)} dimension(s): {len(index) - n_ellipsis}")
    if n_ellipsis:
        at = next(i for i, ix in enumerate(index) if ix is Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - explicit) + index[at + 1 :]
    else:
        index = index + (slice(None),) * (len(shape) - explicit)

    axes = []
    for axis, (ix, dim) in enumerate(zip(index, shape, strict=False)):
        if isinstance(ix, list) and not ix:
            # an empty list selects nothing along its axis, as in numpy and the reference
            axes.append((0, 0, 1, False, False))
            continue
        if isinstance(ix, slice):
            if strict_bounds:
                for bound in (ix.start, ix.stop):
                    if bound is not None and not -dim <= operator.index(bound) <= dim:
                        raise InvalidSliceError(f"slice bound {bound} is out of bounds for axis {axis} with size {dim}")
            start, stop, step = ix.indices(dim)
            count = len(range(start, stop, step))
            if step < 0:
                # read the same elements forwards, reverse afterwards
                first = start + (count - 1) * step if count else 0
                axes.append((first, count, -step, False, True))
            else:
                axes.append((start, count, step, False, False))
            continue
        try:
            i = operator.index(ix)
        except TypeError:
            raise InvalidSliceError(
                f"unsupported index {ix!r}: use integers, slices and '...' (no arrays, None or booleans)"
            ) from None
        if isinstance(ix, (bool, np.bool_)):
            raise InvalidSliceError("boolean indices are not supported")
        if not -dim <= i < dim:
            raise InvalidSliceError(f"index {i} is out of bounds for axis {axis} with size {dim}")
        axes.append((i % dim, 1, 1, True, False))
    return axes


def plan_slice(shape: tuple[int, ...], itemsize: int, index, *, strict_bounds: bool = False) -> SlicePlan:
    """Plan the byte runs that ``tensor[index]`` covers.

    Parameters
    ----------
    shape : tuple of int
        Shape of the stored (C-contiguous) tensor.
    itemsize : int
        Bytes per element.
    index : int, slice, Ellipsis, empty list, or tuple of those
        numpy-style basic index; negative integers and steps are allowed.
    strict_bounds : bool, default False
        Refuse slice bounds past their axis instead of clamping them as numpy does (the
        reference's numpy slices refuse them, its torch slices clamp).

    Returns
    -------
    SlicePlan

    Raises
    ------
    InvalidSliceError
        Out-of-range integers, too many indices, or unsupported index types.

    Notes
    -----
    The innermost axes that are selected whole are merged into each run, so a row block
    is a single run and a column block is one run per row.  The number of runs is the
    product of the selected counts of the outer axes: it is computed with numpy in
    O(runs) memory, which is at most the number of elements returned.
    """
    shape = tuple(int(d) for d in shape)
    axes = _normalize(index, shape, strict_bounds)
    out_shape = tuple(count for (_, count, _, _, _) in axes)
    squeeze = tuple(a for a, ax in enumerate(axes) if ax[3])
    flip = tuple(a for a, ax in enumerate(axes) if ax[4])
    forward = tuple(
        start if squeezed else slice(start, start + count * step, step)
        for (start, count, step, squeezed, _) in axes
    )
    if any(c == 0 for c in out_shape):
        return SlicePlan(out_shape, np.zeros(0, np.int64), 0, squeeze, flip, forward)

    # strides in bytes of the stored tensor
    strides = [itemsize] * len(shape)
    for a in range(len(shape) - 2, -1, -1):
        strides[a] = strides[a + 1] * shape[a + 1]

    # merge the whole-selected innermost axes (and one partially selected contiguous axis) into the run
    run_bytes = itemsize
    j = len(shape) - 1
    while j >= 0:
        start, count, step, _, _ = axes[j]
        if start == 0 and count == shape[j] and step == 1:
            run_bytes *= shape[j]
            j -= 1
            continue
        if step == 1:
            run_bytes *= count
            src = np.array([start * strides[j]], np.int64)
            j -= 1
        else:
            src = np.zeros(1, np.int64)
        break
    else:
        return SlicePlan(out_shape, np.zeros(1, np.int64), run_bytes, squeeze, flip, forward)

    # outer axes, from j outwards: every combination of their selected indices
    for a in range(j, -1, -1):
        start, count, step, _, _ = axes[a]
        offs = (start + step * np.arange(count, dtype=np.int64)) * strides[a]
        src = (offs[:, None] + src[None, :]).reshape(-1)
    return SlicePlan(out_shape, src, run_bytes, squeeze, flip, forward)


# -- whole-tensor read plans --------------------------------------------------------------------

#: Default bytes per read request: large enough that the system call costs nothing next to
#: the copy, small enough to spread one big tensor over the reader threads (a GPU load's
#: chunks are the ring's own size).
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024


class Piece(NamedTuple):
    """Part of one tensor carried by a request: ``nbytes`` bytes at ``tensor_offset``."""

    row: int
    tensor_offset: int
    request_offset: int
    nbytes: int


class Request(NamedTuple):
    """One positional read: ``nbytes`` bytes at absolute file ``offset``, split into pieces."""

    offset: int
    nbytes: int
    pieces: tuple[Piece, ...]


def select_rows(table, names=None, *, patterns=None, predicate=None, layers=None) -> list[int]:
    """Rows of a header table chosen by names, glob patterns, a predicate or a layer range.

    Parameters
    ----------
    table : HeaderTable
        From :func:`engine.format.header.read_header` (``header.table``).
    names : iterable of str, optional
        Exact names; an unknown name is an error (a typo should not load nothing).
    patterns : str or iterable of str, optional
        ``fnmatch`` globs such as ``"model.layers.*.mlp.*"``; each must match something.
    predicate : callable, optional
        ``predicate(name) -> bool``.
    layers : range or (start, stop), optional
        Keeps tensors whose name holds ``.layers.{i}.`` (or ``.h.{i}.``, ``.blocks.{i}.``) with
        ``i`` in the range, plus nothing else; combine with ``names`` for embeddings.

    Returns
    -------
    list of int
        Selected rows in file order.  With no criterion, every tensor.  Criteria combine
        with "or": a tensor is loaded when any of them selects it.
    """
    import fnmatch
    import re

    from engine.errors import TensorNotFoundError

    all_names = table.names
    order = table.file_order()
    if names is None and patterns is None and predicate is None and layers is None:
        return order
    chosen: set[int] = set()
    if names is not None:
        if isinstance(names, str):
            names = [names]
        index = table.index
        for name in names:
            row = index.get(name)
            if row is None:
                raise TensorNotFoundError(f"no tensor {name!r} to select", tensors=(name,))
            chosen.add(row)
    if patterns is not None:
        if isinstance(patterns, str):
            patterns = [patterns]
        for pattern in patterns:
            rx = re.compile(fnmatch.translate(pattern))
            hits = [r for r, n in enumerate(all_names) if rx.match(n)]
            if not hits:
                raise TensorNotFoundError(f"pattern {pattern!r} matches no tensor", tensors=(pattern,))
            chosen.update(hits)
    if predicate is not None:
        chosen.update(r for r, n in enumerate(all_names) if predicate(n))
    if layers is not None:
        wanted = layers if isinstance(layers, range) else range(*layers)
        rx = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
        for r, n in enumerate(all_names):
            m = rx.search(n)
            if m and int(m.group(1)) in wanted:
                chosen.add(r)
    return [r for r in order if r in chosen]


def plan_reads(
    begins, ends, rows, data_start: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_pieces: int = 1024
) -> list[Request]:
    """Requests that read the tensors ``rows`` (in file order) and nothing else.

    Neighbouring tensors that touch in the file are coalesced into one request of at most
    ``chunk_bytes`` and ``max_pieces`` tensors (one ``preadv`` takes at most ``IOV_MAX``
    buffers); a larger tensor is split into chunk-sized requests.  A gap between
    selected tensors always ends a request, so a selective load reads exactly the bytes of
    the selected tensors.

    Notes
    -----
    The plan is O(number of requests + tensors) Python objects; it never allocates tensor
    memory.
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    # a multiple of 64 keeps every piece of a split tensor on whole elements (and cache lines)
    chunk_bytes = max(64, chunk_bytes - chunk_bytes % 64)
    requests: list[Request] = []
    cur_start = cur_end = -1
    pieces: list[Piece] = []

    def flush():
        if pieces:
            requests.append(Request(cur_start, cur_end - cur_start, tuple(pieces)))

    for row in rows:
        b = int(begins[row]) + data_start
        e = int(ends[row]) + data_start
        pos = b
        while pos < e:
            if pieces and (pos != cur_end or cur_end - cur_start >= chunk_bytes or len(pieces) >= max_pieces):
                flush()
                pieces = []
            if not pieces:
                cur_start = cur_end = pos
            room = chunk_bytes - (cur_end - cur_start)
            take = e - pos
            if take > room:
                # split the tensor on a 64-byte boundary of its own, so every piece holds
                # whole elements; if none fits in this request, start the next one
                done = pos - b
                take = (done + room) // 64 * 64 - done
                if take <= 0:
                    flush()
                    pieces = []
                    continue
            pieces.append(Piece(row, pos - b, cur_end - cur_start, take))
            cur_end += take
            pos += take
    flush()
    return requests
