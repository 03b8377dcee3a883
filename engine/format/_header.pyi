"""Typed stub of the Cython module engine.format._header (hand-written; keep in step with the .pyx)."""

from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

_T = TypeVar("_T", bound=tuple[Any, ...])
_Row = tuple[str, str, tuple[int, ...], tuple[int, int]]

__all__ = [
    "MAX_HEADER_SIZE",
    "HeaderTable",
    "header_length",
    "parse_header",
    "read_table",
    "open_regular",
    "verifying",
    "VERIFY",
    "check_regions",
    "tensor_nbytes",
]

MAX_HEADER_SIZE: int

class HeaderTable:
    """A validated header: one row per tensor, in header order.  Read-only.

    The array columns (codes, begins, ends, order) are numpy views made on first access.
    """

    @property
    def names(self) -> list[str]: ...
    @property
    def index(self) -> dict[str, int]: ...
    @property
    def codes(self) -> npt.NDArray[np.uint8]: ...
    @property
    def shapes(self) -> list[tuple[int, ...]]: ...
    @property
    def begins(self) -> npt.NDArray[np.int64]: ...
    @property
    def ends(self) -> npt.NDArray[np.int64]: ...
    @property
    def order(self) -> npt.NDArray[np.intp]: ...
    @property
    def metadata(self) -> dict[str, str] | None: ...
    @property
    def header_size(self) -> int: ...
    @property
    def data_size(self) -> int: ...
    def __len__(self) -> int: ...
    def file_order(self) -> list[int]:
        """The rows in file order (``order.tolist()`` without numpy)."""
    def bytes_per_code(self) -> dict[int, int]:
        """Bytes of tensor data per dtype code present, in code order."""
    def dtype_names(self) -> list[str]:
        """The format's dtype name of every row, in header order (no numpy needed)."""
    @overload
    def row(self, i: int) -> _Row: ...
    @overload
    def row(self, i: int, cls: type[_T]) -> _T:
        """``cls((name, dtype_name, shape, (begin, end)))`` for row ``i``."""
    @overload
    def rows(self) -> list[_Row]: ...
    @overload
    def rows(self, cls: type[_T]) -> list[_T]:
        """Every row, in header order."""
    @overload
    def items(self) -> list[tuple[str, _Row]]: ...
    @overload
    def items(self, cls: type[_T]) -> list[tuple[str, _T]]:
        """``(name, row)`` pairs, in header order."""

def header_length(prefix: Buffer, file_size: int, max_header_size: int = ...) -> int: ...
def parse_header(buf: Buffer, data_size: int, strict: bool = ...) -> HeaderTable: ...
VERIFY: ContextVar[bool]

def verifying() -> bool: ...
def open_regular(path: str | bytes) -> int: ...
def read_table(fd: int, file_size: int, max_header_size: int = ..., path: str | None = ...) -> HeaderTable | None: ...
def check_regions(
    begins: npt.ArrayLike,
    ends: npt.ArrayLike,
    data_size: int,
    names: Sequence[str] | None = None,
) -> npt.NDArray[np.intp]: ...
def tensor_nbytes(code: int, shape: Iterable[int]) -> int: ...

class TensorSlice:
    def get_shape(self) -> list[int]: ...
    def get_dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    def __len__(self) -> int: ...
    def __getitem__(self, index: Any) -> Any: ...

class Slicer:
    closed: bool
    def __init__(self, handle: Any, table: HeaderTable) -> None: ...
    def __call__(self, name: str) -> TensorSlice: ...
