"""The reference's raw-pointer serialization API: ``TensorSpec``, ``serialize``,
``serialize_file`` and ``deserialize``.

Framework modules of the reference (``safetensors.torch``, ...) describe each tensor as a
:class:`TensorSpec`: a dtype name, a shape, and the address and length of its bytes.  Code
written against that layer works unchanged here; the bytes go through the engine's writer
(same layout, same atomic file writes) and the engine's header parser.
"""

from __future__ import annotations

import ctypes
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

from engine.base.dtypes import BY_NAME, DTYPES
from engine.errors import SerializationError
from engine.format.header import parse_buffer
from engine.writing.writer import build_header, open_writer

__all__ = ["TensorSpec", "serialize", "serialize_file", "deserialize"]

#: dtype names a TensorSpec accepts (torch's spellings, as the reference takes them) -> format code
_SPEC_DTYPES = {d.torch: d.code for d in DTYPES if d.torch}
_SPEC_DTYPES["float4_e2m1fn_x2"] = BY_NAME["F4"].code
_F4 = _SPEC_DTYPES["float4_e2m1fn_x2"]


class TensorSpec:
    """One tensor handed to :func:`serialize` / :func:`serialize_file`: dtype, shape and memory.

    Parameters
    ----------
    dtype : str
        torch's name of the dtype (``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``,
        ``"float4_e2m1fn_x2"``, ...); an unknown name raises at once.
    shape : sequence of int
        The shape.  For ``float4_e2m1fn_x2`` the framework's storage shape may be given;
        the last dimension is doubled to the format's element count, as the reference does.
    data_ptr : int
        Address of the tensor's contiguous little-endian bytes.  The memory must stay alive
        and unchanged until the serialization that uses this spec returns.
    data_len : int
        Length of those bytes.

    Raises
    ------
    SerializationError
        Unknown dtype, negative dimensions or length, or a null address with bytes to read.
    """

    __slots__ = ("_code", "_shape", "_ptr", "_len")

    def __init__(self, *, dtype: str, shape: Sequence[int], data_ptr: int, data_len: int) -> None:
        code = _SPEC_DTYPES.get(dtype) if isinstance(dtype, str) else None
        if code is None:
            raise SerializationError(
                f'Unknown dtype "{dtype}". Supported dtypes: {", ".join(_SPEC_DTYPES)}', reason="InvalidDtype"
            )
        try:
            dims = [operator.index(d) for d in shape]
            ptr, size = operator.index(data_ptr), operator.index(data_len)
        except TypeError:
            raise SerializationError(
                f"TensorSpec needs integer shape, data_ptr and data_len, got {shape!r}, {data_ptr!r}, {data_len!r}",
                reason="InvalidShape",
            ) from None
        if any(d < 0 for d in dims) or size < 0 or ptr < 0:
            raise SerializationError(
                f"TensorSpec: negative shape, address or length ({dims}, {ptr}, {size})", reason="InvalidShape"
            )
        if size and not ptr:
            raise SerializationError(f"TensorSpec: {size} bytes at a null address", reason="InvalidPointer")
        if code == _F4 and dims:
            dims[-1] *= 2
        self._code, self._shape, self._ptr, self._len = code, dims, ptr, size

    @property
    def dtype(self) -> str:
        """The format's dtype code (``"F32"``, ``"BF16"``, ...), as written in the header."""
        return DTYPES[self._code].name

    @property
    def shape(self) -> list[int]:
        """The shape as the header records it (element counts)."""
        return list(self._shape)

    @property
    def data_ptr(self) -> int:
        return self._ptr

    @property
    def data_len(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"TensorSpec(dtype={self.dtype!r}, shape={self._shape}, data_ptr={self._ptr}, data_len={self._len})"

    def _bytes(self) -> memoryview:
        # a view of the caller's memory, no copy
        if not self._len:
            return memoryview(b"")
        return memoryview((ctypes.c_ubyte * self._len).from_address(self._ptr)).cast("B")


def _specs(tensor_dict: Any) -> list[tuple[str, TensorSpec]]:
    if not isinstance(tensor_dict, Mapping):
        raise TypeError(f"argument 'tensor_dict': expected a dict of str to TensorSpec, got {type(tensor_dict).__name__}")
    items = list(tensor_dict.items())
    for _, spec in items:
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"argument 'tensor_dict': {type(spec).__name__!r} object is not an instance of 'TensorSpec'")
    return items


def serialize(tensor_dict: Mapping[str, TensorSpec], metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file holding the tensors that ``tensor_dict`` describes.

    Raises
    ------
    TypeError
        A value that is not a :class:`TensorSpec`.
    SerializationError
        A length that does not match dtype and shape, bad names or metadata.

    Notes
    -----
    Copies of tensor bytes: 1, straight from each spec's memory into the result.
    """
    items = _specs(tensor_dict)
    header, layout = build_header(((n, s._code, s._shape, s._len) for n, s in items), metadata)
    return b"".join([header, *(items[index][1]._bytes() for index, _ in layout)])


def serialize_file(
    tensor_dict: Mapping[str, TensorSpec], filename: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
) -> None:
    """Write the tensors that ``tensor_dict`` describes to ``filename``, atomically.

    Raises
    ------
    TypeError, SerializationError
        As :func:`serialize`.
    WriteError
        The file could not be written; any previous file is left intact.

    Notes
    -----
    Copies of tensor bytes: 0 in user space (each spec's memory is written with ``pwrite``).
    The GIL is released around every write, so other threads run meanwhile.
    """
    items = _specs(tensor_dict)
    # validated in full (lengths against shapes) before the file is created
    build_header(((n, s._code, s._shape, s._len) for n, s in items), metadata)
    with open_writer(filename, ((n, s._code, s._shape) for n, s in items), metadata) as w:
        for name, spec in items:
            w.write(name, spec._bytes())


def deserialize(bytes: bytes) -> list[tuple[str, dict[str, Any]]]:  # the reference names it so (shadows the builtin)
    """The tensors of a whole safetensors file in memory, in file order.

    Parameters
    ----------
    bytes : bytes-like
        The whole file (the reference's parameter name, so ``deserialize(bytes=...)`` works).

    Returns
    -------
    list of (name, {"shape": list of int, "dtype": str, "data": bytearray})

    Raises
    ------
    HeaderError
        The header breaks a rule of the format.

    Notes
    -----
    Copies of tensor bytes: 1 (each tensor into its own ``bytearray``, as the reference returns).
    """
    data = bytes
    header = parse_buffer(data)
    t = header.table
    start = header.data_start
    view = memoryview(data).cast("B")
    out = []
    for row in t.file_order():
        b, e = int(t.begins[row]), int(t.ends[row])
        out.append(
            (
                t.names[row],
                {"shape": list(t.shapes[row]), "dtype": DTYPES[int(t.codes[row])].name, "data": bytearray(view[start + b : start + e])},
            )
        )
    return out
