"""engine.writing.tensorspec: the reference's TensorSpec / serialize / serialize_file / deserialize."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors

import engine
from engine import TensorSpec, deserialize, serialize, serialize_file


def _spec(a: np.ndarray, dtype: str) -> TensorSpec:
    return TensorSpec(dtype=dtype, shape=a.shape, data_ptr=a.ctypes.data if a.nbytes else 0, data_len=a.nbytes)


ARRAYS = {
    "w": (np.arange(12, dtype=np.float32).reshape(3, 4), "float32"),
    "b": (np.arange(6, dtype=np.uint16), "bfloat16"),
    "i": (np.array([1, -2, 3], dtype=np.int64), "int64"),
    "e": (np.zeros((0, 3), dtype=np.uint8), "uint8"),
    "f4": (np.arange(8, dtype=np.uint8).reshape(2, 4), "float4_e2m1fn_x2"),
}


def _both():
    ours = {k: _spec(a, d) for k, (a, d) in ARRAYS.items()}
    theirs = {
        k: safetensors.TensorSpec(dtype=d, shape=a.shape, data_ptr=a.ctypes.data if a.nbytes else 0, data_len=a.nbytes)
        for k, (a, d) in ARRAYS.items()
    }
    return ours, theirs


def test_tensor_spec_like_the_reference():
    ours, theirs = _both()
    for k in ours:
        assert (ours[k].dtype, ours[k].shape, ours[k].data_len) == (theirs[k].dtype, theirs[k].shape, theirs[k].data_len)
    assert ours["f4"].shape == [2, 8]  # the storage shape's last dimension doubled
    with pytest.raises(engine.SafetensorError, match="Unknown dtype"):
        TensorSpec(dtype="F32", shape=[1], data_ptr=0, data_len=0)
    with pytest.raises(engine.SerializationError):
        TensorSpec(dtype="float32", shape=[1], data_ptr=0, data_len=4)  # bytes at a null address
    with pytest.raises(TypeError):
        TensorSpec("float32", [1], 0, 0)  # keyword-only, as the reference


def test_serialize_is_byte_identical_to_the_reference(tmp_path):
    ours, theirs = _both()
    meta = {"format": "pt"}
    assert serialize(ours, metadata=meta) == safetensors.serialize(theirs, metadata=meta)
    serialize_file(ours, tmp_path / "a.safetensors", metadata=meta)
    assert (tmp_path / "a.safetensors").read_bytes() == safetensors.serialize(theirs, metadata=meta)
    with pytest.raises(TypeError):
        serialize({"x": {"dtype": "F32", "shape": [1], "data": b"\0" * 4}})
    bad = {"x": TensorSpec(dtype="float32", shape=[2], data_ptr=ARRAYS["w"][0].ctypes.data, data_len=4)}
    with pytest.raises(engine.SafetensorError):
        serialize(bad)
    with pytest.raises(engine.SafetensorError):
        serialize_file(bad, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


def test_deserialize_like_the_reference():
    ours, _ = _both()
    data = serialize(ours)
    # the reference returns them in its hash map's order; ours is file order
    assert dict(deserialize(data)) == dict(safetensors.deserialize(data))
    assert [k for k, _ in deserialize(data)] == engine.format.header.parse_buffer(data).offset_keys()
    with pytest.raises(engine.HeaderError):
        deserialize(data[:20])
