"""numpy destination: writable views of a private mapping, or owned writable arrays."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.base import dtypes

if TYPE_CHECKING:
    import mmap


class NumpySink:
    name = "numpy"
    on_device = False
    # arrays are writable, as the reference hands them out: a private (copy-on-write)
    # mapping lets callers write without touching the file, and copies only the pages
    # written.  The name of an ``mmap`` constant, so that opening a file needs no ``mmap``.
    mmap_access = "ACCESS_COPY"

    def map(self, mm: mmap.mmap):
        return mm

    def view(self, base, code: int, shape: tuple, offset: int, nbytes: int) -> np.ndarray:
        """Zero-copy array over ``nbytes`` at absolute ``offset`` of ``base`` (writable when
        ``base`` is: a private mapping, an owned block)."""
        if code in dtypes.SUB_BYTE_CODES:
            shape = dtypes.packed_shape(code, shape, nbytes)
        try:
            return np.ndarray(shape, dtypes.numpy_dtype(code), buffer=base, offset=offset)
        except (ValueError, OverflowError) as exc:
            # rank above numpy's limit, dimensions past 63 bits, or more bytes than it can index
            from engine.errors import UnrepresentableTensorError

            raise UnrepresentableTensorError(
                f"numpy cannot build an array of shape {dtypes.shape_text(shape)}: {exc}", reason="UnrepresentableShape"
            ) from None

    def allocate(self, specs, file_begins):
        """Owned arrays for ``specs`` = [(row, code, shape, nbytes)], views of one block.

        Returns (row -> array, row -> writable byte memoryview).
        """
        from engine.sinks._host import host_block, pack_offsets  # owned loads only

        offsets, total = pack_offsets(specs, file_begins)
        block = host_block(total)
        tensors, views = {}, {}
        whole = memoryview(block)
        for (row, code, shape, nbytes), off in zip(specs, offsets, strict=True):
            tensors[row] = self.view(block, code, shape, off, nbytes)
            if nbytes:
                views[row] = whole[off : off + nbytes]
        return tensors, views

    def empty(self, code: int, shape: tuple, nbytes: int) -> np.ndarray:
        return np.empty(dtypes.packed_shape(code, shape, nbytes), dtypes.numpy_dtype(code))

    @staticmethod
    def raw(arr: np.ndarray) -> memoryview:
        """Writable byte view of an owned C-contiguous array (no copy)."""
        return memoryview(arr.reshape(-1).view(np.uint8))

    @staticmethod
    def finish(arr, flip: tuple, result_shape: tuple):
        if flip:
            arr = np.flip(arr, flip)
        return arr.reshape(result_shape)

    @staticmethod
    def to_device(arr):
        return arr
