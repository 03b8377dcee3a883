"""The 22 dtypes of the safetensors format and their numpy, torch and CuPy counterparts.

Each dtype has a small integer *code*.  Codes follow the reference implementation's
dtype order (``BOOL < F4 < ... < U64``), which is also the order its writer uses to
lay tensors out (descending code, then name), so sorting by code reproduces the
reference's files byte for byte.

Sub-byte dtypes (``F4``, ``F6_E2M3``, ``F6_E3M2``) have no byte-addressable element; the
engine hands them out as their packed bytes (``uint8``), see :func:`packed_shape`.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, NamedTuple

from engine.base._dtype_rows import BITS as _BITS
from engine.base._dtype_rows import NAMES as _NAMES
from engine.base._dtype_rows import ROWS

if TYPE_CHECKING:
    import numpy as np

    class _DTypeFields(NamedTuple):
        code: int
        name: str  # the format's spelling, e.g. "BF16"
        bits: int  # bits per element; 4 and 6 for the sub-byte dtypes
        numpy: str  # numpy / ml_dtypes type name the engine uses for this dtype
        torch: str | None  # attribute of the torch module, None where torch has none
else:
    # the same tuple class as typing.NamedTuple would make, without compiling each field's
    # string annotation at import, which typing.NamedTuple does on every first open
    _DTypeFields = collections.namedtuple("DType", ["code", "name", "bits", "numpy", "torch"])

__all__ = [
    "DType",
    "shape_text",
    "DTYPES",
    "BY_NAME",
    "NAMES",
    "BITS",
    "SUB_BYTE_CODES",
    "code_of",
    "numpy_dtype",
    "own_numpy_dtype",
    "from_numpy",
    "torch_dtype",
    "from_torch",
    "packed_shape",
]


class DType(_DTypeFields):
    """One dtype of the format: ``code``, ``name`` (the format's spelling, e.g. ``"BF16"``),
    ``bits`` per element (4 and 6 for the sub-byte dtypes), the ``numpy`` / ml_dtypes type
    name the engine uses, and the ``torch`` attribute (None where torch has none)."""

    __slots__ = ()

    @property
    def itemsize(self) -> int:
        """Bytes per element, 1 for packed sub-byte dtypes (their storage unit)."""
        return max(self.bits // 8, 1)

    @property
    def sub_byte(self) -> bool:
        return self.bits % 8 != 0


# Order matters: it is the reference's enum order (see module docstring).
DTYPES: tuple[DType, ...] = tuple(DType(code, *row) for code, row in enumerate(ROWS))

BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
#: Format names indexed by code; the Cython parser hands out codes.
NAMES: tuple[str, ...] = _NAMES
#: Bits per element indexed by code.
BITS: tuple[int, ...] = _BITS
#: codes of the dtypes narrower than a byte, handed out packed (see :func:`packed_shape`)
SUB_BYTE_CODES: frozenset[int] = frozenset(d.code for d in DTYPES if d.sub_byte)


def code_of(name: str) -> int:
    """Code of a format dtype name such as ``"BF16"``."""
    try:
        return BY_NAME[name].code
    except KeyError:
        from engine.errors import SerializationError

        raise SerializationError(f"unknown safetensors dtype {name!r}", reason="InvalidDtype") from None


def own_numpy_dtype(code: int) -> np.dtype | None:
    """numpy's own dtype for a code (little-endian), or ``None`` where numpy has none and
    ``ml_dtypes`` supplies it (BF16, FP8); imports no ``ml_dtypes``.  Packed sub-byte
    codes give ``uint8``, as :func:`numpy_dtype` does."""
    import numpy as np

    try:
        dt = np.dtype(DTYPES[code].numpy)
    except TypeError:  # not a name numpy knows (ml_dtypes not imported yet)
        return None
    # once ml_dtypes is imported numpy resolves its names too: keep numpy's own only
    return dt.newbyteorder("<") if dt.type.__module__ == "numpy" else None


def _np_type(d: DType) -> np.dtype:
    dt = own_numpy_dtype(d.code)
    if dt is not None:
        return dt
    import ml_dtypes  # numpy has none (BF16, FP8): ml_dtypes' type
    import numpy as np

    return np.dtype(getattr(ml_dtypes, d.numpy))


# numpy dtypes per code, each made on first use: reading headers imports no numpy, and
# arrays of numpy's own dtypes import no ml_dtypes (about 7 ms for a short-lived tool)
_NUMPY: list[np.dtype | None] = [None] * len(DTYPES)
# and back, for every dtype at once (saving): made on first use
_FROM_NUMPY: dict[np.dtype, int] = {}


def numpy_dtype(code: int) -> np.dtype:
    """numpy dtype for a code; little-endian; ``uint8`` for packed sub-byte dtypes."""
    dt = _NUMPY[code]
    if dt is None:
        dt = _NUMPY[code] = _np_type(DTYPES[code])
    return dt


def from_numpy(dtype: np.dtype) -> int:
    """Code for a numpy dtype (any byte order); raises SerializationError if unsupported."""
    global _FROM_NUMPY
    import numpy as np

    if not _FROM_NUMPY:
        # built whole, then published: a thread never sees a partial table
        table = {numpy_dtype(d.code): d.code for d in DTYPES if not d.sub_byte}  # uint8 is U8, not packed
        table[np.dtype(np.uint8)] = BY_NAME["U8"].code
        _FROM_NUMPY = table
    dtype = np.dtype(dtype)
    key = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    try:
        return _FROM_NUMPY[key]
    except KeyError:
        from engine.errors import SerializationError

        raise SerializationError(f"numpy dtype {dtype} has no safetensors equivalent", reason="InvalidDtype") from None


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - exercised only without the extra
        from engine.errors import MissingDependencyError

        raise MissingDependencyError("torch", "torch", "torch tensors") from None
    return torch


_TORCH_CACHE: dict = {}


#: torch's own packed dtypes for sub-byte formats (one element per byte of packed values)
_TORCH_PACKED = {"F4": "float4_e2m1fn_x2"}


def torch_dtype(code: int):
    """torch dtype for a code.

    Sub-byte dtypes come as torch's packed dtype where it has one (``F4`` as
    ``float4_e2m1fn_x2``, as the reference hands it out), else as ``torch.uint8`` bytes.
    Raises ``SerializationError`` where this torch build has no such dtype.
    """
    if code in _TORCH_CACHE:
        return _TORCH_CACHE[code]
    torch = _torch()
    d = DTYPES[code]
    attr: str | None
    if d.sub_byte:
        attr = _TORCH_PACKED.get(d.name, "uint8")
        if getattr(torch, attr, None) is None:
            attr = "uint8"
    else:
        attr = d.torch
    tdt = getattr(torch, attr, None) if attr else None
    if tdt is None:
        from engine.errors import SerializationError

        raise SerializationError(f"this torch build has no dtype for {d.name}", reason="InvalidDtype")
    _TORCH_CACHE[code] = tdt
    return tdt


def from_torch(dtype) -> int:
    """Code for a torch dtype; raises SerializationError if the format has none."""
    if not _TORCH_REVERSE:
        torch = _torch()
        for d in DTYPES:
            if d.torch and getattr(torch, d.torch, None) is not None:
                _TORCH_REVERSE[getattr(torch, d.torch)] = d.code
        # torch's packed sub-byte dtypes (FP4 two values per byte) are the format's
        for name, attr in _TORCH_PACKED.items():
            if getattr(torch, attr, None) is not None:
                _TORCH_REVERSE[getattr(torch, attr)] = BY_NAME[name].code
    try:
        return _TORCH_REVERSE[dtype]
    except KeyError:
        from engine.errors import SerializationError

        raise SerializationError(f"torch dtype {dtype} has no safetensors equivalent", reason="InvalidDtype") from None


_TORCH_REVERSE: dict = {}


def packed_shape(code: int, shape: tuple[int, ...], nbytes: int) -> tuple[int, ...]:
    """Shape under which a tensor's packed bytes are handed out.

    For byte-sized dtypes this is ``shape``.  For sub-byte dtypes it is ``shape`` with the
    last dimension replaced by its packed byte count when that dimension fills whole bytes
    (``F4[4096, 4096]`` -> ``uint8[4096, 2048]``), else the flat ``(nbytes,)``.
    """
    d = DTYPES[code]
    if not d.sub_byte:
        return shape
    if shape and (shape[-1] * d.bits) % 8 == 0:
        return shape[:-1] + (shape[-1] * d.bits // 8,)
    return (nbytes,)


def shape_text(shape) -> str:
    """A shape for messages: ``[4096, 11008]``, or its rank and ends when it is long."""
    dims = list(shape)
    if len(dims) <= 8:
        return str(dims)
    return f"rank-{len(dims)} [{dims[0]}, {dims[1]}, ..., {dims[-1]}]"
